"""Workers for the weights-group push tests (gloo ranks): load an actor at TP x PP and push it to
a rollout server with ``rollout.weight_push: group``; variants that poison a weight or kill the
trainer midway."""

from __future__ import annotations


def _actor(model_path: str, tp: int, pp: int):
    import torch

    import parallel_models as pm

    pm.init_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    arch = pm.registry.architecture_of(model_path)
    return pm.get_model_class(arch, "causal_lm", rmpad=True, pp=pp > 1).from_pretrained(
        model_path, dtype=torch.float32)


def push_group(model_path: str, url: str, tp: int = 1, pp: int = 1, *, pushes: int = 1,
               poison: bool = False, kill_after_buckets: int | None = None,
               kill_pid: int | None = None, fallback_folder: str | None = None) -> dict:
    """Push ``model_path`` (loaded at TP x PP) ``pushes`` times over the weights group (small
    buckets: several per push). ``poison``: one weight gets a NaN first; ``kill_after_buckets``:
    rank 0 SIGKILLs ``kill_pid`` (default: itself) after sending that many buckets;
    ``fallback_folder``: through
    ``push_actor_weights`` (mode group, the folder as fallback). -> the versions and the
    transport, or the error every rank raised."""
    import os
    import signal

    import torch

    from parallel_models.inference.server import weight_group_push
    from parallel_models.inference.server.client import RolloutClient
    from parallel_models.inference import push_actor_weights

    actor = _actor(model_path, tp, pp)
    if poison:
        with torch.no_grad():
            next(actor.parameters()).view(-1)[3] = float("nan")
    if kill_after_buckets is not None:
        send, sent = weight_group_push.GroupPusher.send, []

        def send_then_die(self, flat):
            if len(sent) == kill_after_buckets:
                os.kill(kill_pid or os.getpid(), signal.SIGKILL)
            send(self, flat)
            sent.append(1)

        weight_group_push.GroupPusher.send = send_then_die
        weight_group_push.GROUP_BUCKET_BYTES = 64 * 1024  # several buckets through any path
    client = RolloutClient(url, timeout=60)
    try:
        if fallback_folder is not None:
            return {"version": push_actor_weights(actor, client, fallback_folder, "group")}
        versions = [weight_group_push.push_weight_group(actor, client, bucket_bytes=64 * 1024)
                    for _ in range(pushes)]
        pusher = getattr(client, "_group_pusher", None)
        return {"versions": versions,
                "transport": pusher.side.transport if pusher is not None else None}
    except Exception as err:  # noqa: BLE001 - the test reads it
        return {"error": f"{type(err).__name__}: {err}"}
    finally:
        client.close()
