"""Pushing a trainer's model to the rollout server: ``push_actor_weights`` streams it
(``weight_stream.py``, no folder on disk), broadcasts it over a process group with the server
(``weight_group_push.py``) or, as the fallback or on request, saves an HF folder the server loads
(``push_weights``). The trainer's side of a server rollout (its batch from the server's answers)
is RL's: ``parallel_models/rl/rollout/server.py``.
"""

from __future__ import annotations

import os


def push_weights(model, client, folder: str) -> int | None:
    """Save ``model`` as an HF folder (every rank calls; rank 0 writes) and have the server load
    it. Returns the server's new weight version on global rank 0 (None elsewhere). The folder
    must be readable by the server (same machine or a shared file system)."""
    import torch.distributed as dist

    model.save_pretrained(folder, overwrite=True)  # the server reads it only during the update
    version = None
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        version = client.update_weights(os.path.abspath(folder))["weight_version"]
    if dist.is_initialized():
        dist.barrier()
    return version


def push_actor_weights(model, client, folder: str, mode: str = "stream") -> int | None:
    """Every rank calls. ``mode="stream"``: stream the weights to the server; ``"group"``:
    broadcast them over a process group with the server (``weight_group_push.py``); if either
    fails (server gone, push rejected), warn and fall back to the folder; ``"folder"``: the
    folder only. Either failing leaves the server on its old weights; if both fail, every rank
    raises ``RuntimeError`` naming the server and both causes. Returns the new version."""
    import logging

    from parallel_models.inference.server.weight_group_push import push_weight_group
    from parallel_models.inference.server.weight_stream import (WeightStreamError,
                                                                 push_weight_stream)

    if mode in ("stream", "group"):
        try:
            push = push_weight_stream if mode == "stream" else push_weight_group
            return push(model, client)
        except WeightStreamError as err:
            logging.getLogger(__name__).warning("%s; falling back to the folder %s", err, folder)
            stream_error = err
    else:
        stream_error = None
    try:
        return push_weights(model, client, folder)
    except Exception as err:  # noqa: BLE001 - one clear error naming both attempts
        first = f" (the {mode} push failed first: {stream_error})" if stream_error else ""
        raise RuntimeError(f"could not push the actor's weights to the rollout server at "
                           f"{client.url}: {type(err).__name__}: {err}{first}; the server "
                           "keeps its previous weights") from err
