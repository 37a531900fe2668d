"""The exact-mode switch and the routing of ops to the batch-invariant kernels.

:func:`exact_mode` (a context manager; re-entrant) turns the mode on for the code inside it:
a ``TorchFunctionMode`` sends ``torch.matmul`` / ``mm`` / ``addmm`` / ``F.linear`` /
``torch._grouped_mm`` / last-dim ``softmax`` / the row-wise ``index_add_`` and
``scatter_add_`` (megatron-core's MoE combine) to the Triton kernels, and :func:`enabled` tells
the model's own hooks (attention, RMSNorm, log-probs) to do the same. Megatron-core's layers are
used as they are; with the mode off nothing is intercepted.

Gradients: each exact op computes its forward with the exact kernel and its backward by
recomputing the ordinary PyTorch op in autograd (:func:`with_reference_grad`): the update only
needs gradients, the forward values (hence the on-policy ratio, exactly 1) are the exact ones.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from parallel_models.errors import ConfigError

_DEPTH = 0  # exact_mode() nesting (process-wide: autograd's backward threads see it too)
_local = threading.local()  # .reference: inside a reference recompute (exact mode paused)


def enabled() -> bool:
    """Whether the batch-invariant kernels are in use (exact mode on, not in a backward
    recompute)."""
    return _DEPTH > 0 and not getattr(_local, "reference", False)


@contextlib.contextmanager
def reference_math():
    """Run the ordinary PyTorch ops inside (the reference recompute of a backward)."""
    before = getattr(_local, "reference", False)
    _local.reference = True
    try:
        yield
    finally:
        _local.reference = before


def runs_here(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can take ``t``: CUDA tensors, or any with the interpreter."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def check_available() -> None:
    """Raise ConfigError when exact mode cannot run here (no Triton)."""
    try:
        import triton  # noqa: F401
    except ImportError as err:
        raise ConfigError("rollout.exact: true needs Triton (pip install triton; on a CPU "
                          f"machine also TRITON_INTERPRET=1): {err}") from None


class _ReferenceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, exact_fn, reference_fn, *tensors):
        ctx.reference_fn = reference_fn
        ctx.save_for_backward(*tensors)
        return exact_fn(*tensors)

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(t.requires_grad) if t is not None else None
                  for t in ctx.saved_tensors]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        with torch.enable_grad(), reference_math():
            out = ctx.reference_fn(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (None, None, *[next(grads) if t is not None and t.requires_grad else None
                              for t in inputs])


def with_reference_grad(exact_fn, reference_fn, *tensors):
    """``exact_fn(*tensors)``; its backward is that of ``reference_fn(*tensors)`` (recomputed)."""
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in tensors)
    if not needs_grad:
        return exact_fn(*tensors)
    if reference_fn is None:
        raise RuntimeError("this exact-mode op was called without its reference op, which "
                           "its gradient needs")
    return _ReferenceGrad.apply(exact_fn, reference_fn, *tensors)


# ---- the ops routed by the TorchFunctionMode -----------------------------------------------

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _is_float(*ts) -> bool:
    return all(isinstance(t, torch.Tensor) and t.dtype in _FLOATS and runs_here(t) for t in ts)


def _matmul(a, b):
    from parallel_models.llama.layers.exact import triton_matmul

    def exact(a, b):
        return triton_matmul.matmul(a.reshape(-1, a.shape[-1]), b).view(*a.shape[:-1], b.shape[1])

    return with_reference_grad(exact, torch.matmul, a, b)


def _grouped_mm(a, b, offs):
    from parallel_models.llama.layers.exact import triton_matmul

    def reference(a, b):
        ends = offs.tolist()
        outs, start = [], 0
        for e, end in enumerate(ends):
            outs.append(a[start:end] @ b[e])
            start = end
        return torch.cat(outs)

    return with_reference_grad(lambda a, b: triton_matmul.grouped_matmul(a, b, offs),
                               reference, a, b)


def _softmax(x, dtype=None):
    from parallel_models.llama.layers.exact import triton_rows

    return with_reference_grad(lambda x: triton_rows.softmax(x, dtype),
                               lambda x: torch.softmax(x, -1, dtype=dtype), x)


def _index_add_rows(base, index, source):
    from parallel_models.llama.layers.exact import triton_rows

    return with_reference_grad(lambda b, s: triton_rows.index_add_rows(b, index, s),
                               lambda b, s: b.index_add(0, index, s), base, source)


def _arg(args, kwargs, i, name, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


class _ExactOps(TorchFunctionMode):
    """Sends the batch-dependent torch ops of megatron-core's layers to the exact kernels."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if enabled():
            out = self._route(func, args, kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)

    def _route(self, func, args, kwargs):
        if func in _MATMULS and "out" not in kwargs and len(args) == 2:
            a, b = args
            if _is_float(a, b) and a.dtype == b.dtype and a.dim() >= 2 and b.dim() == 2:
                return _matmul(a, b)
        elif func is F.linear:
            x, w, bias = args[0], _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
            if _is_float(x, w) and x.dtype == w.dtype and w.dim() == 2 and x.dim() >= 2:
                out = _matmul(x, w.t())
                return out if bias is None else out + bias
        elif func in _ADDMMS and len(args) == 3 and not kwargs:
            bias, a, b = args
            if _is_float(a, b) and a.dtype == b.dtype and a.dim() == 2:
                return _matmul(a, b) + bias
        elif func in _GROUPED:
            a, b, offs = args[0], args[1], kwargs.get("offs")
            if (offs is not None and _is_float(a, b) and a.dtype == b.dtype and a.dim() == 2
                    and b.dim() == 3 and set(kwargs) <= {"offs"}):
                return _grouped_mm(a, b, offs)
        elif func in _SOFTMAXES:
            x, dim = args[0], _arg(args, kwargs, 1, "dim")
            if (_is_float(x) and dim is not None and dim in (-1, x.dim() - 1)
                    and x.shape[-1] <= SOFTMAX_MAX_ROW and set(kwargs) <= {"dim", "dtype"}):
                return _softmax(x, kwargs.get("dtype"))
        elif func in _INDEX_ADDS:
            return self._index_add(func, args, kwargs)
        elif func in _TOPKS:
            return self._sorted_topk(func, args, kwargs)
        return NotImplemented

    @staticmethod
    def _sorted_topk(func, args, kwargs):
        """Top-k always sorted: megatron-core >= 0.19 asks for ``sorted=torch.is_grad_enabled()``,
        and an unsorted top-k's order depends on the kernel (hence on the batch) and differs
        between the scoring (no grad) and the update (grad) forwards; the router's softmax over
        the k scores then sums them in another order (fp32 probabilities 3e-8 apart)."""
        if len(args) > 4:
            args = (*args[:4], True, *args[5:])
        else:
            kwargs = {**kwargs, "sorted": True}
        return func(*args, **kwargs)

    @staticmethod
    def _index_add(func, args, kwargs):
        if kwargs or len(args) != 4 or args[1] != 0:
            return NotImplemented
        base, _, index, source = args
        if func is torch.Tensor.scatter_add_:  # index expanded from one column
            if index.dim() != 2 or index.stride(1) != 0:
                return NotImplemented
            index = index[:, 0]
        if not (_is_float(base, source) and base.dim() == 2 and source.dim() == 2
                and index.dim() == 1):
            return NotImplemented
        result = _index_add_rows(base.clone(), index, source)  # (base is overwritten next)
        base.copy_(result)
        return base


# softmax rows routed (the MoE router's, over experts); longer ones (a sampler's over the
# vocab, which no log-prob reads) keep PyTorch's kernel: one program per row would not fit
SOFTMAX_MAX_ROW = 8192
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.mm, torch.Tensor.mm, torch.Tensor.__matmul__}
_ADDMMS = {torch.addmm, torch.Tensor.addmm}
_GROUPED = {getattr(torch, "_grouped_mm", None)} - {None}
_SOFTMAXES = {torch.softmax, torch.Tensor.softmax, F.softmax}
_INDEX_ADDS = {torch.Tensor.index_add_, torch.Tensor.scatter_add_}
_TOPKS = {torch.topk, torch.Tensor.topk}


@contextlib.contextmanager
def exact_mode(on: bool = True):
    """Run the code inside with the batch-invariant kernels (``on=False``: a no-op, so callers
    can write ``with exact_mode(cfg.rollout.exact):``). Also switches ``torch.compile`` of the
    elementwise ops off for the duration (``utils.gpu_compile``)."""
    global _DEPTH
    if not on:
        yield
        return
    check_available()
    from parallel_models.utils import gpu_compile

    compiling = gpu_compile.compilation_enabled()
    gpu_compile.set_compilation(False)
    _DEPTH += 1
    try:
        with _ExactOps():
            yield
    finally:
        _DEPTH -= 1
        if _DEPTH == 0:
            gpu_compile.set_compilation(compiling)
