"""Weights pushed to a TP > 1 rollout server, forwarded from its rank 0 to the other ranks as
raw tensor broadcasts over the server's control group (gloo, host memory).

Rank 0 staged the pushed model as bucket payloads (``weight_stream.StreamParser``: one host
buffer per bucket, the HF tensors views of it). The ``update_pushed`` command carries only the
buckets' headers (names, dtypes, shapes, byte counts); then each bucket's bytes go out with one
``dist.broadcast`` of a uint8 tensor, straight from rank 0's buffer into a buffer of the same size
on every other rank, where the same headers cut it into the same tensors. Nothing is pickled but
the headers (the model as one pickled object cost a serialisation, a copy and an unpickling per
rank). The receivers allocate every buffer first and the ranks agree (one all-reduce) before any
byte moves, so a rank out of host memory cannot leave the others blocked in a broadcast. The swap
stays all or nothing: every rank loads through ``RolloutEngine.update_weights`` with the control
group, which votes (a rank that could not stage the push votes no).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel_models.inference.server.weight_stream import (PushedWeights, WeightStreamError,
                                                             unpack_bucket)


def _as_bytes(payload: bytearray) -> torch.Tensor:
    return (torch.frombuffer(payload, dtype=torch.uint8) if len(payload)
            else torch.empty(0, dtype=torch.uint8))


def _all_ready(ready: bool, group) -> bool:
    failed = torch.tensor([0 if ready else 1], dtype=torch.int32)
    dist.all_reduce(failed, group=group)
    return int(failed) == 0


class NotStaged(PushedWeights):
    """What a rank that could not stage the push loads: reading any tensor raises, so its
    ``update_weights`` votes no and every rank keeps its old weights."""

    def __init__(self, reason: str):
        super().__init__({}, [])
        self.reason = reason

    def __call__(self, name, dim, start, end):
        raise WeightStreamError(f"the pushed weights were not staged on this rank: {self.reason}")


def send_pushed(weights: PushedWeights, group) -> bool:
    """Rank 0 (after the ``update_pushed`` command): broadcast every bucket's bytes once every
    rank has its buffers. False if a rank could not allocate them (nothing sent)."""
    if not _all_ready(True, group):
        return False
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for _, payload in weights.frames:
        if len(payload):
            dist.broadcast(_as_bytes(payload), src=src, group=group)
    return True


def receive_pushed(headers: list[tuple[list, int]], group) -> PushedWeights:
    """Ranks > 0: receive the buckets announced by ``headers`` -> the same tensors as rank 0's
    (:class:`NotStaged` if this or another rank could not allocate the buffers)."""
    try:
        payloads = [bytearray(nbytes) for _, nbytes in headers]
        reason = None
    except MemoryError:
        payloads, reason = [], "out of host memory for the staged weights"
    if not _all_ready(reason is None, group):
        return NotStaged(reason or "another rank could not stage them")
    src = dist.get_global_rank(group, 0) if group is not None else 0
    tensors: dict[str, torch.Tensor] = {}
    frames = []
    for (entries, _), payload in zip(headers, payloads):
        if len(payload):
            dist.broadcast(_as_bytes(payload), src=src, group=group)
        unpack_bucket(entries, payload, tensors)
        frames.append((entries, payload))
    return PushedWeights(tensors, frames)


__all__ = ["NotStaged", "receive_pushed", "send_pushed"]
