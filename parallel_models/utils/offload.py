"""Move idle models and optimizer states to host memory between PPO phases (CUDA only).

Parameters move to pinned CPU memory and back (the ``Parameter`` objects stay the same, so
optimizers and DDP keep their references). megatron DDP's gradient buffers hold nothing between
steps, so their storage is released and re-allocated (the ``main_grad`` views into them stay
valid). Optimizer states (Adam moments, fp32 master weights) move like parameters.
Without CUDA every call is a no-op: there is no device memory to free.
"""

from __future__ import annotations

import contextlib

import torch


def _device() -> torch.device | None:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def _move(t: torch.Tensor, device) -> torch.Tensor:
    if device.type == "cpu":
        if not t.is_cuda:
            return t
        # straight into pinned memory (torch's caching host allocator reuses the blocks between
        # phases): one DMA copy at full PCIe speed. ``.to("cpu").pin_memory()`` went through
        # pageable memory first, a synchronous slow copy plus a second host copy. The caller
        # synchronizes before the host tensors are read.
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        return host.copy_(t, non_blocking=True)
    return t.to(device, non_blocking=True)


def _grad_buffers(model) -> list[torch.Tensor]:
    bufs = []
    for attr in ("buffers", "expert_parallel_buffers"):
        found = getattr(model, attr, None)
        if not isinstance(found, (list, tuple)):  # nn.Module.buffers is a method, DDP's a list
            continue
        for b in found:
            if getattr(b, "grad_data", None) is not None:
                bufs.append(b.grad_data)
    return bufs


def offload_model(model) -> None:
    """Parameters and buffers to pinned CPU memory; DDP grad buffers freed."""
    if _device() is None:
        return
    for p in model.parameters():
        p.data = _move(p.data, torch.device("cpu"))
    for m in model.modules():
        for name, buf in list(m._buffers.items()):
            if buf is not None:
                m._buffers[name] = _move(buf, torch.device("cpu"))
    for g in _grad_buffers(model):
        storage = g.untyped_storage()
        g._offload_nbytes = storage.nbytes()
        storage.resize_(0)
    torch.cuda.synchronize()  # the host copies are complete before anyone reads them
    torch.cuda.empty_cache()


def onload_model(model) -> None:
    device = _device()
    if device is None:
        return
    for p in model.parameters():
        p.data = _move(p.data, device)
    for m in model.modules():
        for name, buf in list(m._buffers.items()):
            if buf is not None:
                m._buffers[name] = _move(buf, device)
    for g in _grad_buffers(model):
        nbytes = getattr(g, "_offload_nbytes", None)
        if nbytes and g.untyped_storage().nbytes() == 0:
            g.untyped_storage().resize_(nbytes)
            g.zero_()


def _optimizer_tensors(optimizer):
    """(holder dict, key) pairs of every state tensor and fp32 master weight of a megatron (or
    torch) optimizer, including chained ones."""
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
                yield p, "data"


def _move_optimizer(optimizer, device) -> None:
    for holder, key in _optimizer_tensors(optimizer):
        if key == "data":
            holder.data = _move(holder.data, device)
        else:
            holder[key] = _move(holder[key], device)


def offload_optimizer(optimizer) -> None:
    if _device() is not None:
        _move_optimizer(optimizer, torch.device("cpu"))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def onload_optimizer(optimizer) -> None:
    device = _device()
    if device is not None:
        _move_optimizer(optimizer, device)


@contextlib.contextmanager
def on_device(model=None, optimizer=None, enabled: bool = True):
    """Bring ``model`` (and ``optimizer`` states) to the GPU for the block, then send them back
    to the host. ``enabled=False`` (or no CUDA) leaves everything where it is."""
    active = enabled and _device() is not None
    if active:
        if model is not None:
            onload_model(model)
        if optimizer is not None:
            onload_optimizer(optimizer)
    try:
        yield
    finally:
        if active:
            if optimizer is not None:
                offload_optimizer(optimizer)
            if model is not None:
                offload_model(model)
