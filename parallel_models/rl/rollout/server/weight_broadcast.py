"""Weights pushed to a TP > 1 rollout server, forwarded from its rank 0 to the other ranks as
raw tensor broadcasts over the server's control group (gloo, host memory).

Rank 0 staged the pushed model as bucket payloads (``weight_stream.StreamParser``: one host
buffer per bucket, the HF tensors views of it). The ``update_pushed`` command carries only the
buckets' headers (names, dtypes, shapes, byte counts); then each bucket's bytes go out with one
``dist.broadcast`` of a uint8 tensor, straight from rank 0's buffer into a buffer of the same size
on every other rank, where the same headers cut it into the same tensors. Nothing is pickled but
the headers (the model as one pickled object cost a serialisation, a copy and an unpickling per
rank). The swap stays all or nothing: every rank loads through ``RolloutEngine.update_weights``
with the control group, which votes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel_models.rl.rollout.server.weight_stream import PushedWeights, unpack_bucket


def _as_bytes(payload: bytearray) -> torch.Tensor:
    return (torch.frombuffer(payload, dtype=torch.uint8) if len(payload)
            else torch.empty(0, dtype=torch.uint8))


def send_pushed(weights: PushedWeights, group) -> None:
    """Rank 0: broadcast every bucket's bytes (after the ``update_pushed`` command)."""
    for _, payload in weights.frames:
        if len(payload):
            dist.broadcast(_as_bytes(payload), src=dist.get_global_rank(group, 0)
                           if group is not None else 0, group=group)


def receive_pushed(headers: list[tuple[list, int]], group) -> PushedWeights:
    """Ranks > 0: receive the buckets announced by ``headers`` -> the same tensors as rank 0's."""
    tensors: dict[str, torch.Tensor] = {}
    frames = []
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for entries, nbytes in headers:
        payload = bytearray(nbytes)
        if nbytes:
            dist.broadcast(_as_bytes(payload), src=src, group=group)
        unpack_bucket(entries, payload, tensors)
        frames.append((entries, payload))
    return PushedWeights(tensors, frames)


__all__ = ["receive_pushed", "send_pushed"]
