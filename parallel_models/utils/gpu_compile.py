"""``torch.compile`` for elementwise/reduction code on CUDA only, one switch for all of it.

Functions wrapped with :func:`compiled_on_gpu` keep their eager definition (the CPU path and the
reference) and, on CUDA tensors, run through ``torch.compile``, which fuses their passes over the
activations into a few Triton kernels (forward and backward). The option ``compile`` off
(``parallel_models.options``; env ``PARALLEL_MODELS_COMPILE=0``; read at the first CUDA call)
switches compilation off; :func:`set_compilation` does the same at run time (benchmarks compare).
"""

from __future__ import annotations

import functools
import types

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


def variant_key(args: tuple) -> tuple:
    """What makes dynamo compile a function again, apart from shapes: per tensor argument its
    dtype, rank, ``requires_grad`` and whether it is a view; the grad mode; numbers by their type
    (their values stay dynamo's to specialize or not); other arguments as they are."""
    key = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.dim(), a.requires_grad, a._base is not None, a.device.type))
        elif isinstance(a, (int, float)) and not isinstance(a, bool):
            key.append(type(a))  # dynamo's business (a temperature must not add variants)
        else:
            key.append(a)
    return tuple(key)


class PerVariantCompile:
    """``torch.compile(eager_fn)`` once per :func:`variant_key`, each on its own copy of the
    function's code.

    Dynamo keeps its compiled entries per code object and gives up on one after
    ``recompile_limit`` (8) entries. One elementwise op is called by the rollout, by scoring
    under ``no_grad``, by trainable and frozen (LoRA) models and again by activation
    recomputation: more than 8 variants, so one shared code object hit the limit and every
    further call re-checked its 8 entries, failed and logged before running eagerly (113,022
    times in the 8B PPO + LoRA-critic run). With a code copy per variant, dynamo sees one variant
    per code object and only its shapes vary (dynamic after the first change). A variant that
    still hits the limit runs eagerly from then on, without calling dynamo again. (PyTorch 2.13
    added ``torch.compile(..., isolate_recompiles=True)``, a region of entries per compile call,
    to the same end; the GPU hosts run 2.11, so the code copies, which work on every version.)
    """

    def __init__(self, eager_fn, backend: str = "inductor"):
        self.eager_fn = eager_fn
        self.backend = backend
        self.compiled: dict[tuple, object] = {}

    def __call__(self, *args):
        key = variant_key(args)
        fn = self.compiled.get(key)
        if fn is None:
            fn = self.compiled[key] = torch.compile(
                self._code_copy(len(self.compiled)), fullgraph=True, backend=self.backend)
        if fn is self.eager_fn:
            return fn(*args)
        try:
            return fn(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            # too many shapes for this variant: it runs eagerly (same values) from now on
            _warn_recompile_limit(self.eager_fn)
            self.compiled[key] = self.eager_fn
            return self.eager_fn(*args)

    def _code_copy(self, index: int):
        f = self.eager_fn
        name = f"{f.__name__}_variant{index}"
        code = f.__code__.replace(co_name=name, co_qualname=name)
        copy = types.FunctionType(code, f.__globals__, name, f.__defaults__, f.__closure__)
        copy.__kwdefaults__ = f.__kwdefaults__
        return copy


def compiled_on_gpu(eager_fn):
    """``eager_fn`` on CPU tensors; on CUDA tensors its ``torch.compile``d version, one per
    input variant (:class:`PerVariantCompile`; compiled on first use)."""
    compiled = PerVariantCompile(eager_fn)

    @functools.wraps(eager_fn)
    def call(*args):
        if not (_ENABLED and args[0].is_cuda and _compile_available()):
            return eager_fn(*args)
        return compiled(*args)

    return call


@functools.cache
def _warn_recompile_limit(fn) -> None:
    import warnings

    warnings.warn(f"torch.compile of {fn.__qualname__} hit dynamo's recompile limit for one "
                  "input variant; its further calls run eagerly", stacklevel=3)
