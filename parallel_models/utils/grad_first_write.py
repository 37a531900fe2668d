"""megatron DDP's fp32 gradient buffers written, not accumulated, by a step's first backward.

megatron-core's DDP zeroes its gradient buffers at the start of every step (``zero_grad_buffer``:
a memset, 4 bytes per parameter) and its backward hook adds each weight's gradient into them
(``main_grad.add_(grad)``: reads 4 + 2 bytes and writes 4 per parameter in bf16 training). For
a step's first microbatch both are wasted work: the sum is the gradient itself. At the
Llama-3-8B shape on an H100 those adds were 34.9 ms, 9.8 % of a training step
(docs/PERFORMANCE.md).

With this on (the default; the option ``grad_first_write``, env
``PARALLEL_MODELS_GRAD_FIRST_WRITE=0``, turns it off when DDP is built):

- ``zero_grad_buffer`` leaves the buffers' contents and marks every parameter's ``main_grad``
  stale (megatron's bucket bookkeeping is reset as before);
- the backward hook copies the gradient into a stale ``main_grad`` (then it is fresh); later
  microbatches of the step add as before; both by a vectorized Triton kernel on CUDA
  (``grad_buffer_kernels``: PyTorch's mixed-dtype ``copy_`` / ``add_`` run unvectorized);
- before the buffers are reduced over data-parallel ranks (``finish_grad_sync``, which
  ``finalize_model_grads`` calls first), a parameter that got no gradient this step has its
  ``main_grad`` zeroed, as megatron's memset would have left it.

The values are megatron's (``0 + g == g`` in fp32). Parts of a buffer that belong to no
parameter (alignment padding) are zero from allocation and stay zero: nothing writes them but the
reduction, which sums zeros. The path falls back to megatron's memset whenever a linear of the
model accumulates its weight gradient into the buffer itself (``utils/wgrad_fusion``, opt-in),
since that adds to whatever the buffer holds, and for overlapped gradient reduction (not used here).

:func:`building` must surround the DDP construction (megatron registers its hooks there);
:func:`enable` then switches one DDP wrapper.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from parallel_models.options import option

STALE = "_pm_main_grad_stale"
ON = "_pm_first_write"  # set on the parameters of a switched DDP wrapper


def wanted() -> bool:
    return option("grad_first_write")


@functools.cache
def _kernel_module():
    try:
        from parallel_models.utils import grad_buffer_kernels
    except ImportError:  # no triton
        return None
    return grad_buffer_kernels


def _accumulate(main_grad: torch.Tensor, grad: torch.Tensor, add: bool) -> None:
    """``main_grad`` written (``add`` false) or added with ``grad``: on CUDA by a vectorized
    Triton kernel (``grad_buffer_kernels``; the option ``grad_buffer_kernel`` off: PyTorch's
    ``copy_`` / ``add_``), elsewhere by PyTorch. The same values either way."""
    if (main_grad.is_cuda and main_grad.dtype == torch.float32 and main_grad.is_contiguous()
            and grad.is_contiguous() and grad.numel() == main_grad.numel()
            and option("grad_buffer_kernel") and _kernel_module() is not None):
        _kernel_module().accumulate(main_grad, grad, add)
    elif add:
        main_grad.add_(grad)
    else:
        main_grad.copy_(grad)


def _make_hook(original):
    """megatron's hook maker wrapped: on a switched wrapper's parameter the gradient is written
    into a stale ``main_grad`` or added to a fresh one here, and megatron's hook then only does
    its bookkeeping (``grad = None``, bucket readiness)."""

    def make(ddp, param):
        inner = original(ddp, param)

        def hook(*unused):
            if (getattr(param, ON, False) and param.grad is not None
                    and not param.grad_added_to_main_grad):
                _accumulate(param.main_grad, param.grad.data, add=not getattr(param, STALE, False))
                setattr(param, STALE, False)
                param.grad_added_to_main_grad = True  # megatron's hook: do not add it again
                try:
                    return inner(*unused)
                finally:
                    param.grad_added_to_main_grad = False
            return inner(*unused)

        return hook

    return make


@contextlib.contextmanager
def building():
    """Around ``DistributedDataParallel(...)``: its backward hooks get the stale-copy path (inert
    until :func:`enable` marks buffers stale)."""
    from megatron.core.distributed import DistributedDataParallel as DDP

    original = DDP._make_backward_post_hook
    DDP._make_backward_post_hook = _make_hook(original)
    try:
        yield
    finally:
        DDP._make_backward_post_hook = original


def _accumulates_in_place(module) -> bool:
    return any(getattr(m, "gradient_accumulation_fusion", False) for m in module.modules())


def enable(ddp, on: bool | None = None) -> bool:
    """Switch the DDP wrapper ``ddp`` (built under :func:`building`) to first-write buffers
    (``on``: None = as :func:`wanted` says; False restores megatron's methods, for benchmarks
    that compare); returns whether it is switched on."""
    originals = ddp.__dict__.get("_pm_first_write_originals")
    if originals is not None:  # back to megatron's methods first
        ddp.zero_grad_buffer, ddp.finish_grad_sync = originals
        del ddp._pm_first_write_originals
        for p in ddp.params_with_grad:
            setattr(p, STALE, False)
            setattr(p, ON, False)
    if on is None:
        on = wanted()
    if not on or ddp.ddp_config.overlap_grad_reduce:
        return False
    original_zero, original_finish = ddp.zero_grad_buffer, ddp.finish_grad_sync
    params = list(ddp.params_with_grad)

    def zero_grad_buffer():
        if _accumulates_in_place(ddp.module):
            for p in params:
                setattr(p, STALE, False)
            return original_zero()
        for p in params:
            p.grad_added_to_main_grad = False
            setattr(p, STALE, True)
        for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
            group.reset()

    def finish_grad_sync(*args, **kwargs):
        for p in params:
            if getattr(p, STALE, False):  # no gradient this step
                p.main_grad.zero_()
                setattr(p, STALE, False)
        return original_finish(*args, **kwargs)

    for p in params:
        setattr(p, ON, True)
        setattr(p, STALE, False)  # as built: the buffers hold zeros
    ddp._pm_first_write_originals = (original_zero, original_finish)
    ddp.zero_grad_buffer, ddp.finish_grad_sync = zero_grad_buffer, finish_grad_sync
    return True


__all__ = ["building", "enable", "wanted"]
