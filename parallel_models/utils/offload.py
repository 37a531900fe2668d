"""Move a model's weights, gradient buffers and optimizer states off the compute device and back.

One implementation for every role that idles between PPO phases (actor, reference, critic,
reward model). :class:`Offloader` tracks

* parameters and module buffers of the model chunks (the ``Parameter`` objects stay the same,
  only ``.data`` is swapped, so optimizers and DDP keep their references); plain ``.grad``
  tensors of models without megatron DDP;
* megatron DDP's contiguous gradient buffers (``grad_data``): they hold nothing between
  optimizer steps, so their storage is released and re-allocated zeroed (the ``main_grad``
  views into them stay valid);
* optimizer states (Adam moments, step counters, fp32 master weights of a megatron mixed-
  precision optimizer, chained optimizers included), as a second group that can stay on the
  host while only the model is needed.

A tensor moves when it lives on the compute device. On CUDA it goes to pinned host memory
(one buffer per tensor, reused between phases: a full-speed DMA copy) and comes back with a
non-blocking copy. When the compute device is the CPU the host copy is a fresh storage: nothing
is freed, but the bookkeeping (what moved, how many bytes, bit-identical round trip) is the
same and testable on a CPU-only machine. Every move returns the bytes taken off (or put back
on) the compute device.

megatron-core has pieces of this (``_ParamAndGradBuffer.offload_to_cpu``, DDP's
``offload_grad_buffers``, ``MegatronOptimizer.offload_to_cpu`` / ``restore_from_cpu``), but only
for DDP-wrapped models and megatron optimizers, CUDA-only (``.cuda()``, pinned buffers) and, for
the optimizer, through pageable memory (a synchronous, slower copy, new host tensors each time);
the frozen reference and reward models need the same moves, and this one runs on a CPU machine.
Parameters that live in DDP's parameter buffer (the distributed optimizer) move with that buffer,
as one copy, its device storage released and re-allocated like the gradient buffers'.

``Offloader(..., refilled=True)`` is for a model whose parameters the caller writes again after
every onload (the hybrid engine's rollout copy, which the weight sync overwrites before each
generation): their device storage is released without a host copy (no pinned host memory, no
transfer either way) and re-allocated unwritten on onload.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["Offloader", "OffloadingRole", "ddp_grad_buffers"]

MODEL, OPTIMIZER = "model", "optimizer"


def ddp_grad_buffers(module) -> list[torch.Tensor]:
    """The ``grad_data`` tensors of a megatron-core DDP wrapper (empty for other modules)."""
    out = []
    for attr in ("buffers", "expert_parallel_buffers"):
        found = getattr(module, attr, None)
        if not isinstance(found, (list, tuple)):  # nn.Module.buffers is a method, DDP's a list
            continue
        out += [b.grad_data for b in found if getattr(b, "grad_data", None) is not None]
    return out


def _ddp_param_buffers(module) -> list[torch.Tensor]:
    """The ``param_data`` tensors of a megatron-core DDP wrapper on the distributed optimizer
    (its parameters are views into them; empty otherwise)."""
    out = []
    for attr in ("buffers", "expert_parallel_buffers"):
        found = getattr(module, attr, None)
        if isinstance(found, (list, tuple)):
            out += [b.param_data for b in found if getattr(b, "param_data", None) is not None]
    return out


def _optimizer_holders(optimizer) -> Iterator[tuple[Any, Any]]:
    """(holder, key) of every state tensor and fp32 master weight of a torch or megatron
    optimizer (chained ones included); ``key`` is ``None`` for a master parameter."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", opt)
        for state in torch_opt.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    yield state, key
        for group in getattr(opt, "shard_fp32_from_float16_groups", None) or \
                getattr(opt, "fp32_from_float16_groups", None) or []:
            for p in group:
                yield p, None


class _Slot:
    """One tensor reference that can be read and replaced (a parameter's ``.data``, a module
    buffer, a parameter's ``.grad``, an optimizer state entry)."""

    __slots__ = ("holder", "key", "kind")

    def __init__(self, kind: str, holder, key=None):
        self.kind, self.holder, self.key = kind, holder, key

    def get(self) -> torch.Tensor:
        if self.kind == "data":
            return self.holder.data
        if self.kind == "grad":
            return self.holder.grad
        return self.holder[self.key] if self.kind == "state" else self.holder._buffers[self.key]

    def set(self, value: torch.Tensor) -> None:
        if self.kind == "data":
            self.holder.data = value
        elif self.kind == "grad":
            self.holder.grad = value
        elif self.kind == "state":
            self.holder[self.key] = value
        else:
            self.holder._buffers[self.key] = value


class Offloader:
    """Offload ``modules`` (one model or a list of chunks) and ``optimizer`` to host memory.

    ``offload()`` / ``onload()`` act on the model and, unless ``with_optimizer=False``, on the
    optimizer; both return the bytes moved and are idempotent (a second call moves 0).
    ``on_device()`` is the context manager a phase uses.
    """

    def __init__(self, modules, optimizer=None, device: torch.device | str | None = None,
                 refilled: bool = False):
        if device is None:
            from parallel_models.distributed import compute_device

            device = compute_device()
        self.modules = list(modules) if isinstance(modules, (list, tuple)) else [modules]
        self.optimizer = optimizer
        self.device = torch.device(device)
        self._host: dict[tuple[str, int], torch.Tensor] = {}  # pinned host copies, reused
        self._moved: dict[str, list[_Slot]] = {MODEL: [], OPTIMIZER: []}
        # storages released on the device, re-allocated on onload: (tensor, nbytes, zero it
        # then) for DDP's gradient buffers (zeroed) and the parameters of a refilled model (not)
        self._freed: dict[int, tuple[torch.Tensor, int, bool]] = {}
        self._parked: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # param buffers
        self.offloaded = {MODEL: False, OPTIMIZER: False}
        # refilled: the parameters' values are written again after every onload (a rollout copy
        # the weight sync overwrites): offload frees their device storage and copies nothing to
        # the host; onload re-allocates it, unwritten. Module buffers move as usual.
        self.refilled = refilled

    @property
    def is_offloaded(self) -> bool:
        """Whether the model is on the host (the optimizer may follow separately)."""
        return self.offloaded[MODEL]

    # ---- what moves ----------------------------------------------------------------------------
    def model_slots(self) -> list[_Slot]:
        """Every parameter, module buffer and plain ``.grad`` once (shared tensors once). A
        ``.grad`` that views a DDP grad buffer (megatron sets ``grad = main_grad``) is not a
        slot: the buffer's storage is released and restored under it."""
        buffer_storages = {g.untyped_storage().data_ptr() for g in self.grad_buffers()}
        param_storages = {g.untyped_storage().data_ptr() for g in self.param_buffers()}
        slots, seen = [], set()
        for chunk in self.modules:
            for module in chunk.modules():
                for p in module._parameters.values():
                    if p is not None and id(p) not in seen:
                        seen.add(id(p))
                        if p.untyped_storage().data_ptr() not in param_storages:
                            slots.append(_Slot("data", p))  # (else it moves with its buffer)
                        if p.grad is not None and \
                                p.grad.untyped_storage().data_ptr() not in buffer_storages:
                            slots.append(_Slot("grad", p))
                for name, b in module._buffers.items():
                    if b is not None and id(b) not in seen:
                        seen.add(id(b))
                        slots.append(_Slot("buffer", module, name))
        return slots

    def optimizer_slots(self) -> list[_Slot]:
        if self.optimizer is None:
            return []
        return [_Slot("data", h) if k is None else _Slot("state", h, k)
                for h, k in _optimizer_holders(self.optimizer)]

    def grad_buffers(self) -> list[torch.Tensor]:
        return [g for chunk in self.modules for g in ddp_grad_buffers(chunk)]

    def param_buffers(self) -> list[torch.Tensor]:
        return [g for chunk in self.modules for g in _ddp_param_buffers(chunk)]

    # ---- moves ---------------------------------------------------------------------------------
    def _on_compute_device(self, t: torch.Tensor) -> bool:
        if t.device.type != self.device.type:
            return False
        return self.device.index is None or t.device.index == self.device.index

    def _to_host(self, group: str, k: int, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t.detach().clone()  # CPU compute device: a fresh storage, honest bookkeeping
        host = self._host.get((group, k))
        if host is None or host.shape != t.shape or host.dtype != t.dtype:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            self._host[(group, k)] = host
        return host.copy_(t, non_blocking=True)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t.detach().clone()
        return t.to(self.device, non_blocking=True)

    def _offload_group(self, group: str) -> int:
        if self.offloaded[group]:
            return 0
        slots = self.model_slots() if group == MODEL else self.optimizer_slots()
        moved, nbytes = [], 0
        for k, slot in enumerate(slots):
            t = slot.get()
            if not self._on_compute_device(t):
                continue  # already on the host (e.g. a CPU-built buffer): nothing to free
            if self.refilled and group == MODEL and slot.kind == "data":
                nbytes += self._release(t, zero=False)  # (shared by tied parameters: once)
                continue
            nbytes += t.numel() * t.element_size()
            slot.set(self._to_host(group, k, t))
            moved.append(slot)
        if group == MODEL:
            for g in self.grad_buffers():
                if self._on_compute_device(g):
                    nbytes += self._release(g, zero=True)
            nbytes += self._park_param_buffers()
        self._moved[group] = moved
        self.offloaded[group] = True
        return nbytes

    def _onload_group(self, group: str) -> int:
        if not self.offloaded[group]:
            return 0
        nbytes = 0
        for slot in self._moved[group]:
            t = slot.get()
            nbytes += t.numel() * t.element_size()
            slot.set(self._to_device(t))
        if group == MODEL:
            for g, size, zero in self._freed.values():
                g.untyped_storage().resize_(size)
                if zero:
                    g.zero_()
                nbytes += size
            self._freed = {}
            for g, host, size in self._parked:
                g.untyped_storage().resize_(size)
                g.copy_(host, non_blocking=True)
                nbytes += size
            self._parked = []
        self._moved[group] = []
        self.offloaded[group] = False
        return nbytes

    def _release(self, t: torch.Tensor, zero: bool) -> int:
        """Free ``t``'s device storage until onload re-allocates it (zeroed with ``zero``, else
        unwritten); the bytes freed (0 for a storage already released through another view)."""
        storage = t.untyped_storage()
        size = storage.nbytes()
        if size:
            self._freed[id(t)] = (t, size, zero)
            storage.resize_(0)
        return size

    def _park_param_buffers(self) -> int:
        """The distributed optimizer's parameter buffers (the parameters are views into them):
        copied to the host, then their device storage released; ``onload`` re-allocates it and
        copies back, so the views (parameters, the optimizer's fp32 shards of fp32 models)
        stay valid."""
        nbytes = 0
        for k, g in enumerate(self.param_buffers()):
            storage = g.untyped_storage()
            if not self._on_compute_device(g) or not storage.nbytes():
                continue
            host = self._to_host("param_buffer", k, g)
            if g.device.type != "cpu":
                torch.cuda.synchronize(g.device)  # the copy lands before the storage goes
            self._parked.append((g, host, storage.nbytes()))
            nbytes += storage.nbytes()
            storage.resize_(0)
        return nbytes

    def _sync(self, free_cache: bool) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # host copies complete before anyone reads them
            if free_cache:
                torch.cuda.empty_cache()

    def offload(self, with_optimizer: bool = True) -> int:
        """Model (and optimizer states) to host memory; returns the bytes taken off the device."""
        nbytes = self._offload_group(MODEL)
        if with_optimizer:
            nbytes += self._offload_group(OPTIMIZER)
        self._sync(free_cache=nbytes > 0)
        return nbytes

    def onload(self, with_optimizer: bool = True) -> int:
        """Model (and optimizer states) back to the compute device; returns the bytes moved."""
        nbytes = self._onload_group(MODEL)
        if with_optimizer:
            nbytes += self._onload_group(OPTIMIZER)
        return nbytes

    @contextlib.contextmanager
    def on_device(self, with_optimizer: bool = False, offload_after: bool | None = None):
        """The model (and the optimizer states when ``with_optimizer``) on the compute device for
        the block. Afterwards what this call brought over goes back to the host; with
        ``offload_after=True`` everything goes back, with ``False`` everything stays."""
        was = dict(self.offloaded)
        self.onload(with_optimizer=with_optimizer)
        try:
            yield self
        finally:
            if offload_after is None:
                if was[MODEL]:
                    self._offload_group(MODEL)
                if with_optimizer and was[OPTIMIZER]:
                    self._offload_group(OPTIMIZER)
                self._sync(free_cache=True)
            elif offload_after:
                self.offload(with_optimizer=True)


class OffloadingRole:
    """The offload half of the trainer's role protocol for a role that holds an ``offloader``
    (:class:`Offloader`, or the fsdp backend's): ``offload`` / ``onload`` return the bytes moved,
    ``on_device`` keeps the role (and its optimizer states) on the device for a phase."""

    offloader: Any

    def offload(self) -> int:
        return self.offloader.offload()

    def onload(self) -> int:
        return self.offloader.onload()

    def on_device(self, with_optimizer: bool = False):
        return self.offloader.on_device(with_optimizer=with_optimizer)

    def updating(self):
        """An update phase of a role that stays resident (no trainer.offload): what it releases
        between updates comes back for it (nothing here; megatron roles: their gradient
        buffers, ``utils/idle_grad_buffers.py``)."""
        return contextlib.nullcontext()
