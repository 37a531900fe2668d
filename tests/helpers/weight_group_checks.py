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


def push_while_in_flight(first: str, second: str, url: str, prompts: list[list[int]],
                         max_new: int) -> dict:
    """Two group pushes from one trainer (``first``'s weights, then ``second``'s) with a greedy
    ``/generate`` request queued between them, so that the second push lands while the
    request's rows are in flight, every time: push 1's job holds the server's batcher (it waits
    for this trainer's go vote) until the request and push 2's manifest are queued behind it, in
    that order (``/info``'s request count moves in the same event-loop turn as the request is
    queued); the batcher's next turn then submits the rows, runs one engine step and swaps push
    2 in (``ContinuousBatcher._run``). -> the two versions, the request's samples (tokens,
    log-probs, per-token ``weight_versions``, finish reasons) and, per token, transformers'
    log-prob and greedy choice under the weights of the version that drew it (one forward over
    the sample)."""
    import threading
    import time
    import uuid

    import torch
    from transformers import AutoModelForCausalLM

    from parallel_models.inference.server.client import RolloutClient
    from parallel_models.inference.server.weight_group_push import pusher_of
    from parallel_models.inference.weight_sync import BucketGatherer
    from parallel_models.llama.checkpoint_utils.loader import load_hf_weights

    actor = _actor(first, 1, 1)
    client = RolloutClient(url, timeout=60)
    pusher = pusher_of(client)
    gatherer = BucketGatherer(actor, 64 * 1024)  # several buckets per push
    pusher.connect(gatherer.device)
    ids = [uuid.uuid4().hex, uuid.uuid4().hex]
    client.weights_group("update", pusher.manifest(gatherer, ids[0]))  # push 1 holds the batcher
    requests = client.info()["stats"]["requests"]
    answer: dict = {}

    def generate():
        try:
            answer.update(client.generate(prompts, greedy=True, max_new_tokens=max_new,
                                          ignore_eos=True, return_text=False))
        except Exception as err:  # noqa: BLE001 - the test reads it
            answer["error"] = f"{type(err).__name__}: {err}"

    request = threading.Thread(target=generate)
    request.start()
    deadline = time.monotonic() + 30
    while client.info()["stats"]["requests"] == requests:  # until the request is queued
        if time.monotonic() > deadline:
            raise TimeoutError("the /generate request never reached the server")
        time.sleep(0.005)
    client.weights_group("update", pusher.manifest(gatherer, ids[1]))  # push 2, behind it

    def send(push_id: str) -> int:  # push_weight_group's rank-0 steps after the manifest
        if pusher.side.max([0])[0]:
            raise RuntimeError("the server could not stage the push")
        for bucket, _ in gatherer.buckets_iter():
            pusher.send(gatherer.flat(bucket))
        return pusher.finish(push_id)

    versions = [send(ids[0])]
    load_hf_weights(actor, second)
    versions.append(send(ids[1]))
    request.join(60)
    client.close()
    if "results" not in answer:
        return {"versions": versions, "error": answer.get("error", "no answer")}
    by_version = {v: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
                  for v, p in zip(versions, (first, second))}
    samples = []
    for result in answer["results"]:
        for s in result["samples"]:
            prompt, tokens = result["prompt_token_ids"], s["token_ids"]
            seq = torch.tensor([prompt + tokens])
            recomputed, greedy = [], []
            for v in set(s["weight_versions"]) & set(by_version):
                with torch.no_grad():
                    logits = by_version[v](seq).logits[0, len(prompt) - 1:-1].float()
                logps = torch.log_softmax(logits, -1)
                for t, (token, drawn) in enumerate(zip(tokens, s["weight_versions"])):
                    if drawn == v:
                        recomputed.append((t, float(logps[t, token])))
                        greedy.append((t, int(logits[t].argmax())))
            samples.append({**s, "recomputed": [x for _, x in sorted(recomputed)],
                            "greedy": [x for _, x in sorted(greedy)]})
    return {"versions": versions, "samples": samples, "weight_version": answer["weight_version"]}
