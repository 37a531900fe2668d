"""Offload of an FSDP2-sharded model (its parameter shards and buffers) and of its optimizer's
states between PPO phases, with the same API as ``utils.offload.Offloader`` (``offload`` /
``onload`` return the bytes moved; ``on_device`` for a phase).

The megatron roles' ``Offloader`` swaps each parameter's ``.data``; an FSDP2 parameter is a
DTensor whose shard FSDP keeps its own reference to, so here the model moves with
``module.to(device)`` (FSDP2 re-registers the moved shards, the ``Parameter`` objects stay, so
the optimizer keeps them) and the optimizer states (DTensors) move tensor by tensor. When the
compute device is the CPU nothing moves (0 bytes).
"""

from __future__ import annotations

import contextlib

import torch

from parallel_models.rl.backends.fsdp.models import compute_device


def _nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


class FSDPOffloader:
    def __init__(self, model, optimizer=None, device=None):
        self.model = model
        self.optimizer = optimizer
        self.device = torch.device(device) if device is not None else compute_device()
        self.offloaded = {"model": False, "optimizer": False}

    @property
    def is_offloaded(self) -> bool:
        return self.offloaded["model"]

    def _model_bytes(self) -> int:
        return sum(_nbytes(t) for t in list(self.model.parameters()) + list(self.model.buffers()))

    def _move_optimizer(self, device) -> int:
        moved = 0
        if self.optimizer is None:
            return 0
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if torch.is_tensor(v) and v.device != device and not (k == "step" and v.dim() == 0
                                                                     and v.device.type == "cpu"):
                    state[k] = v.to(device, non_blocking=device.type == "cuda")
                    moved += _nbytes(v)
        return moved

    def _move(self, group: str, device, offloaded: bool) -> int:
        if self.device.type == "cpu" or self.offloaded[group] == offloaded:
            return 0
        if group == "model":
            nbytes = self._model_bytes()
            self.model.to(device)
        else:
            nbytes = self._move_optimizer(device)
        self.offloaded[group] = offloaded
        return nbytes

    def offload(self, with_optimizer: bool = True) -> int:
        nbytes = self._move("model", torch.device("cpu"), True)
        if with_optimizer:
            nbytes += self._move("optimizer", torch.device("cpu"), True)
        if nbytes and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return nbytes

    def onload(self, with_optimizer: bool = True) -> int:
        nbytes = self._move("model", self.device, False)
        if with_optimizer:
            nbytes += self._move("optimizer", self.device, False)
        return nbytes

    @contextlib.contextmanager
    def on_device(self, with_optimizer: bool = False, offload_after: bool | None = None):
        """The model (and the optimizer states when asked) on the device for the block. Then
        what this call brought over goes back; ``offload_after=True``: everything goes back,
        ``False``: everything stays (as ``utils.offload.Offloader``)."""
        was = dict(self.offloaded)
        self.onload(with_optimizer=with_optimizer)
        try:
            yield self
        finally:
            if offload_after:
                self.offload()
            elif offload_after is None:
                back = self._move("model", torch.device("cpu"), True) if was["model"] else 0
                if with_optimizer and was["optimizer"]:
                    back += self._move("optimizer", torch.device("cpu"), True)
                if back and self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                    torch.cuda.empty_cache()
