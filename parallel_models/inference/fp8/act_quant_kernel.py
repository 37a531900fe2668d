"""The FP8 rollout's activation quantization as one Triton kernel per linear (CUDA; imported
lazily: triton is not a dependency), ``quantize.quantize_activation``'s recipe bit for bit:
``scale = amax / 448`` (1 for an all-zero group), ``q = e4m3(clamp(x * (1 / scale)))`` (the
division and the reciprocal correctly rounded), either

- per token and 128-wide group of the input features (:func:`quantize_token_groups`, block
  weights), the scales written straight into the token-major (column-major, token count padded
  to 4) layout ``torch._scaled_mm``'s 1 x 128 block-wise mode reads, or
- per token (:func:`quantize_tokens`, channel weights: ``_scaled_mm``'s row-wise mode), one
  program per token: the whole row held in registers up to :data:`WHOLE_ROW_COLS` inputs (one
  read), else read twice (the max, then the values; the second read from L2).

The torch version (``quantize.quantize_activation`` + ``gemm._token_major``) takes seven to
eleven kernels per linear, which at decode batch sizes cost more than the GEMM they feed (on an
H100, the 8B decode step at batch 256 with channel scales took 1.35x bf16's, docs/
PERFORMANCE.md); these are one. ``gemm`` checks them against the torch version once per device
before using them. In Triton's CPU interpreter (whose fp32 -> e4m3 conversion is wrong) the
values are rounded by ``e4m3_rounding.round_to_e4m3`` first, so the tests check the recipe (its
steps: ``e4m3_rounding.e4m3_scale`` and ``scaled_for_e4m3``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from parallel_models.inference.fp8.dependent_launch import (launch_options, release_dependents,
                                                            wait_for_inputs)
from parallel_models.inference.fp8.e4m3_rounding import (e4m3_scale, quantize_and_store,
                                                          scaled_for_e4m3)
from parallel_models.inference.fp8.quantize import BLOCK, E4M3, E4M3_MAX
from parallel_models.llama.layers.exact import interpreter_fix

interpreter_fix.apply()  # (the CPU interpreter's loop bounds; nothing on the GPU)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TOKEN_BLOCK = 1024  # input features a program reads per step of the per-token kernel
WHOLE_ROW_COLS = 16384  # rows up to this wide are quantized in one pass, held in registers
# (the two-pass kernel's dependent loads took 6-11 us for 64 x 4096-14336 on an H100)


@triton.jit
def _quantize_groups_kernel(X, Q, S, n_cols, stride_x, stride_q, ld_s,
                            FP8_MAX: tl.constexpr, GROUP: tl.constexpr, EMULATE: tl.constexpr,
                            PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    release_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = quantize_and_store(x, Q + row * stride_q + cols, mask, FP8_MAX, EMULATE)
    tl.store(S + group * ld_s + row, scale)


@triton.jit
def _quantize_tokens_kernel(X, Q, S, n_cols, stride_x, stride_q, FP8_MAX: tl.constexpr,
                            BLOCK_COLS: tl.constexpr, EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_COLS)
    amax = tl.zeros((BLOCK_COLS,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        x = tl.load(X + row * stride_x + start + offs, mask=start + offs < n_cols, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    amax_row = tl.max(amax, axis=0)
    scale = e4m3_scale(amax_row, FP8_MAX)
    for start in range(0, n_cols, BLOCK_COLS):
        mask = start + offs < n_cols
        x = tl.load(X + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        q = scaled_for_e4m3(x, scale, FP8_MAX, EMULATE)
        tl.store(Q + row * stride_q + start + offs, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row, scale)


def quantize_token_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[tokens, in]`` (CUDA, any float dtype, unit stride along ``in``) -> (e4m3
    ``[tokens, in]``, fp32 scales ``[tokens, ceil(in/128)]`` stored token-major)."""
    tokens, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    groups = -(-cols // BLOCK)
    ld = -(-max(tokens, 1) // 4) * 4
    q = torch.empty(tokens, cols, dtype=E4M3, device=x.device)
    storage = torch.empty(groups, ld, dtype=torch.float32, device=x.device)
    if tokens:
        _quantize_groups_kernel[(tokens, groups)](x, q, storage, cols, x.stride(0), q.stride(0),
                                                  ld, FP8_MAX=E4M3_MAX, GROUP=BLOCK,
                                                  EMULATE=_INTERPRETED, num_warps=1)
    return q, storage[:, :tokens].t()


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[tokens, in]`` (CUDA, any float dtype, unit stride along ``in``) -> (e4m3
    ``[tokens, in]``, fp32 scales ``[tokens, 1]``: ``_scaled_mm``'s row-wise ``scale_a``)."""
    tokens, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(tokens, cols, dtype=E4M3, device=x.device)
    scales = torch.empty(tokens, 1, dtype=torch.float32, device=x.device)
    if tokens and cols <= WHOLE_ROW_COLS:  # (decode: a latency-bound kernel, one pass: the
        block = triton.next_power_of_2(cols)  # group kernel with one group as wide as the row)
        _quantize_groups_kernel[(tokens, 1)](x, q, scales, cols, x.stride(0), q.stride(0), 0,
                                             FP8_MAX=E4M3_MAX, GROUP=block, EMULATE=_INTERPRETED,
                                             num_warps=max(4, min(16, block // 1024)),
                                             **launch_options(x.device))
    elif tokens:
        _quantize_tokens_kernel[(tokens,)](x, q, scales, cols, x.stride(0), q.stride(0),
                                           FP8_MAX=E4M3_MAX, BLOCK_COLS=TOKEN_BLOCK,
                                           EMULATE=_INTERPRETED, num_warps=4)
    return q, scales


__all__ = ["TOKEN_BLOCK", "WHOLE_ROW_COLS", "quantize_token_groups", "quantize_tokens"]
