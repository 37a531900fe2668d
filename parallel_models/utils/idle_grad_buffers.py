"""A trainable role's gradient buffers released while it does not train.

Between two update phases megatron-core DDP's contiguous gradient buffers (``grad_data``) hold
nothing the next update reads: its first step zeroes them (or, with ``grad_first_write``, writes
them) before any gradient lands. Yet they take their bytes on the device through the rollout and
the scoring: 4 bytes per parameter with fp32 gradient reduction, 16 GB per GPU for an 8B model at
TP=2 or PP=2 (docs/PERFORMANCE.md, issue 33), memory the rollout's KV pool could use. With
``trainer.offload`` the :class:`~parallel_models.utils.offload.Offloader` already releases them
with everything else; without it (the roles stay resident, no host copies), this releases only
the gradient buffers: their storage is freed after an update phase and re-allocated, zeroed,
before the next. The ``main_grad`` views, DDP's buckets and the optimizers' gradient shards are
views of that same storage, so they stay valid (the Offloader's mechanism).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from parallel_models.utils.offload import ddp_grad_buffers


class IdleGradBuffers:
    """``IdleGradBuffers(chunks)``: :meth:`release` frees the DDP gradient buffers of
    ``chunks``, :meth:`restore` brings them back zeroed; :meth:`in_use` is an update phase
    (restored on entry, released on exit)."""

    def __init__(self, chunks):
        self.chunks = list(chunks)
        self._released: list[tuple[torch.Tensor, int]] = []

    @property
    def released(self) -> bool:
        return bool(self._released)

    def buffers(self) -> list[torch.Tensor]:
        return [g for chunk in self.chunks for g in ddp_grad_buffers(chunk)]

    def release(self) -> int:
        """Free the buffers' storage (those not already released); the bytes freed."""
        freed = 0
        for g in self.buffers():
            storage = g.untyped_storage()
            size = storage.nbytes()
            if size:
                self._released.append((g, size))
                storage.resize_(0)
                freed += size
        return freed

    def restore(self) -> int:
        """Re-allocate the released buffers, zeroed; the bytes allocated."""
        allocated = 0
        for g, size in self._released:
            g.untyped_storage().resize_(size)
            g.zero_()
            allocated += size
        self._released = []
        return allocated

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """The buffers on the device for an update phase, released again after it."""
        self.restore()
        try:
            yield
        finally:
            self.release()


__all__ = ["IdleGradBuffers"]
