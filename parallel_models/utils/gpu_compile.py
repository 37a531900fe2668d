"""``torch.compile`` for elementwise/reduction code on CUDA only, one switch for all of it.

Functions wrapped with :func:`compiled_on_gpu` keep their eager definition (the CPU path and the
reference) and, on CUDA tensors, run through ``torch.compile``, which fuses their passes over the
activations into a few Triton kernels (forward and backward). The option ``compile`` off
(``parallel_models.options``; env ``PARALLEL_MODELS_COMPILE=0``; read at the first CUDA call)
switches compilation off; :func:`set_compilation` does the same at run time (benchmarks compare).
"""

from __future__ import annotations

import functools

import torch

from parallel_models.options import option

_ENABLED = True


def set_compilation(enabled: bool) -> None:
    global _ENABLED
    _ENABLED = enabled


def compilation_enabled() -> bool:
    return _ENABLED


@functools.cache
def _compile_available() -> bool:
    if not option("compile") or not torch.cuda.is_available():
        return False
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return has_triton()


def compiled_on_gpu(eager_fn):
    """``eager_fn`` on CPU tensors; its ``torch.compile``d version when the first argument is a
    CUDA tensor (compiled on first use)."""
    compiled = None

    @functools.wraps(eager_fn)
    def call(*args):
        nonlocal compiled
        if not (_ENABLED and args[0].is_cuda and _compile_available()):
            return eager_fn(*args)
        if compiled is None:
            compiled = torch.compile(eager_fn, fullgraph=True)
        try:
            return compiled(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            # too many input variants (shapes, dtypes, grad modes) for dynamo's recompile limit:
            # these calls run eagerly (same values) instead of failing the run
            _warn_recompile_limit(eager_fn)
            return eager_fn(*args)

    return call


@functools.cache
def _warn_recompile_limit(fn) -> None:
    import warnings

    warnings.warn(f"torch.compile of {fn.__qualname__} hit dynamo's recompile limit; the "
                  "further input variants run eagerly", stacklevel=3)
