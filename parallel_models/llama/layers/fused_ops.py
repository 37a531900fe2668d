"""Elementwise parts of the decoder (RMSNorm, residual add + RMSNorm, rotary, SwiGLU), fused on GPU.

Each op is written once, in eager PyTorch, with the arithmetic transformers uses (the CPU path and
the reference). On CUDA the same function runs through ``torch.compile``, which turns each one
into one Triton kernel forward and one backward instead of 5-10 elementwise passes over the
activations (in eager mode those passes took ~40% of a training step: bench/train_bench.py
--profile). ``PARALLEL_MODELS_COMPILE=0`` switches compilation off.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from parallel_models.llama.layers.rotary import apply_rotary


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + residual, rms_norm(x + residual)): the pre-norm layer's residual add and next norm."""
    total = x + residual
    return total, _rms_norm(total, weight, eps)


def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q ``[tokens, heads, d]``, k ``[tokens, kv_heads, d]``, cos/sin ``[tokens, d]``."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``[..., 2 * inter]`` holding [gate; up] -> silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@functools.cache
def _compile_available() -> bool:
    if os.environ.get("PARALLEL_MODELS_COMPILE", "1") == "0" or not torch.cuda.is_available():
        return False
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return has_triton()


_ENABLED = True


def set_fusion(enabled: bool) -> None:
    """Switch the compiled kernels on or off at run time (benchmarks compare both)."""
    global _ENABLED
    _ENABLED = enabled


def _on_gpu(eager_fn):
    compiled = None

    @functools.wraps(eager_fn)
    def call(*args):
        nonlocal compiled
        if not (_ENABLED and args[0].is_cuda and _compile_available()):
            return eager_fn(*args)
        if compiled is None:
            compiled = torch.compile(eager_fn, fullgraph=True)
        return compiled(*args)

    call.eager = eager_fn
    return call


rms_norm = _on_gpu(_rms_norm)
add_rms_norm = _on_gpu(_add_rms_norm)
rotary = _on_gpu(_rotary)
swiglu = _on_gpu(_swiglu)
