"""Triton kernels for the decoder's elementwise producers that also write an FP8 copy of their
output: RMSNorm (with or without the residual add before it) and SwiGLU. Besides the output in
the model's dtype, each writes the output quantized per token to e4m3, with its fp32 scale, so
the FP8 linear that reads it next (``tma_decode_kernel``) needs no quantization launch of its own.
Both launch with programmatic dependent launch where it is on (``dependent_launch``), so the
GEMM after them can start and prefetch its weights while they run.
CUDA only; imported lazily, since triton is not a dependency. ``fused_producers`` decides when
they run.

Arithmetic matches the eager references in ``llama/layers/fused_ops``:

- the residual sum is rounded to the model's dtype, then normed;
- ``x * rsqrt(mean(x^2) + eps)`` is computed in fp32 and rounded to the model's dtype, then
  multiplied by the weight, and the product rounded again;
- SwiGLU's ``silu(gate)`` is rounded before the product with ``up``.

The per-token quantization is ``quantize.quantize_activation(y, "channel")`` applied to that
rounded output: ``scale = amax / 448``, and the values multiplied by the correctly rounded
reciprocal (the steps are ``e4m3_rounding``'s). So the copy holds the same values that
``act_quant_kernel.quantize_tokens`` would give from the output. One program handles one token,
with the whole row in registers (rows of up to :data:`MAX_COLS` values).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from parallel_models.inference.fp8.dependent_launch import (launch_options, release_dependents,
                                                            wait_for_inputs)
from parallel_models.inference.fp8.e4m3_rounding import quantize_and_store
from parallel_models.inference.fp8.quantize import E4M3, E4M3_MAX, MAX_PRODUCER_COLS as MAX_COLS
from parallel_models.llama.layers.exact import interpreter_fix

interpreter_fix.apply()  # (the CPU interpreter's loop bounds; nothing on the GPU)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _quantize_row(y, Q, S, row, offs, mask, stride_q, FP8_MAX: tl.constexpr,
                  EMULATE: tl.constexpr):
    """Store fp32 ``y`` (a row of values already in the model's dtype) to ``Q`` as e4m3 with its
    per-token scale in ``S``."""
    y = tl.where(mask, y, 0.0)
    scale = quantize_and_store(y, Q + row * stride_q + offs, mask, FP8_MAX, EMULATE)
    tl.store(S + row, scale)


@triton.jit
def _rms_norm_quant_kernel(X, R, T, W, Y, Q, S, n, stride_x, stride_r, stride_t, stride_y,
                           stride_q, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                           FP8_MAX: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    w = tl.load(W + offs, mask=mask, other=0.0)  # (the norm's weight: no kernel writes it)
    wait_for_inputs(PDL)
    release_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # the sum, rounded to the model's dtype, is what is normed
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(T.dtype.element_ty)
        tl.store(T + row * stride_t + offs, x, mask=mask)
    h = x.to(tl.float32)
    mean_sq = tl.sum(h * h, axis=0) / n
    normed = (h * tl.math.rsqrt(mean_sq + eps)).to(Y.dtype.element_ty)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + row * stride_y + offs, y, mask=mask)
    _quantize_row(y.to(tl.float32), Q, S, row, offs, mask, stride_q, FP8_MAX, EMULATE)


@triton.jit
def _swiglu_quant_kernel(GU, Y, Q, S, inter, stride_gu, stride_y, stride_q, BLOCK: tl.constexpr,
                         FP8_MAX: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    release_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(GU + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_gu + inter + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(Y.dtype.element_ty)
    y = (silu.to(tl.float32) * up).to(Y.dtype.element_ty)
    tl.store(Y + row * stride_y + offs, y, mask=mask)
    _quantize_row(y.to(tl.float32), Q, S, row, offs, mask, stride_q, FP8_MAX, EMULATE)


def _warps(block: int) -> int:
    return max(4, min(16, block // 1024))


def _copy_buffers(rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(rows, cols, dtype=E4M3, device=device),
            torch.empty(rows, dtype=torch.float32, device=device))


def rms_norm_quantized(x2: torch.Tensor, residual2: torch.Tensor | None, weight: torch.Tensor,
                       eps: float):
    """``x2`` (and ``residual2``) ``[rows, n]`` with unit column stride -> (the sum ``x2 +
    residual2`` or None, ``rms_norm`` of it ``[rows, n]``, (e4m3 copy ``[rows, n]``, fp32
    per-token scales ``[rows]``))."""
    rows, n = x2.shape
    if n > MAX_COLS:
        raise ValueError(f"fp8 fused RMSNorm: rows of {n} > {MAX_COLS} values")
    dtype = x2.dtype
    total = torch.empty_like(x2) if residual2 is not None else None
    y = torch.empty(rows, n, dtype=dtype, device=x2.device)
    q, s = _copy_buffers(rows, n, x2.device)
    block = triton.next_power_of_2(n)
    if rows:
        res = residual2 if residual2 is not None else x2
        out_total = total if total is not None else x2
        _rms_norm_quant_kernel[(rows,)](
            x2, res, out_total, weight, y, q, s, n, x2.stride(0), res.stride(0),
            out_total.stride(0), y.stride(0), q.stride(0), float(eps),
            HAS_RESIDUAL=residual2 is not None, BLOCK=block, FP8_MAX=E4M3_MAX,
            EMULATE=_INTERPRETED, num_warps=_warps(block), **launch_options(x2.device))
    return total, y, (q, s)


def swiglu_quantized(gate_up2: torch.Tensor):
    """``gate_up2`` ``[rows, 2I]`` ([gate; up], unit column stride) -> (``silu(gate) * up``
    ``[rows, I]``, (e4m3 copy ``[rows, I]``, fp32 per-token scales ``[rows]``))."""
    rows, two_inter = gate_up2.shape
    inter = two_inter // 2
    if two_inter % 2 or inter > MAX_COLS // 2:
        raise ValueError(f"fp8 fused SwiGLU: a [gate; up] row of {two_inter} values")
    y = torch.empty(rows, inter, dtype=gate_up2.dtype, device=gate_up2.device)
    q, s = _copy_buffers(rows, inter, gate_up2.device)
    block = triton.next_power_of_2(inter)
    if rows:
        _swiglu_quant_kernel[(rows,)](gate_up2, y, q, s, inter, gate_up2.stride(0), y.stride(0),
                                      q.stride(0), BLOCK=block, FP8_MAX=E4M3_MAX,
                                      EMULATE=_INTERPRETED, num_warps=_warps(block),
                                      **launch_options(gate_up2.device))
    return y, (q, s)


__all__ = ["MAX_COLS", "rms_norm_quantized", "swiglu_quantized"]
