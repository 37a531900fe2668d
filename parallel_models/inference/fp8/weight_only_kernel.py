"""The FP8 rollout's decode GEMM: ``y = x @ W^T`` with ``W`` in e4m3 (block or channel scales)
and ``x`` left in its 16-bit dtype (weight-only FP8, "W8A16"), as one Triton kernel (CUDA;
imported lazily: triton is not a dependency).

Why: a decode step is memory-bound, so what FP8 buys there is reading half the weight bytes.
With ``torch._scaled_mm`` the activations must be quantized first (an extra kernel per linear)
and cuBLAS's block-scaled FP8 kernels are slow at 64-256 rows: measured on an H100 (docs/
PERFORMANCE.md, issue 37), W8A8 decode steps were 1.2-2x *slower* than bf16.

How (tiles: :class:`~parallel_models.inference.fp8.decode_tuning.DecodeConfig`, chosen per
shape by ``decode_tuning.choose``):

- a program owns ``block_n`` output features of ``block_m`` rows and walks its K range in
  ``block_k`` steps, the loads pipelined ``num_stages`` deep. The weight tile is the dot's first
  operand (``[block_n, block_k]``, converted e4m3 -> the activation dtype in registers, exact:
  e4m3 fits in bf16/fp16) and the activations the second (``[block_k, block_m]``), so the
  tensor-core tile's long side is the weight rows and its short side the decode batch;
- every weight byte is read from HBM once per call: ``block_m`` covers all the rows of a decode
  bucket, or the row tiles of one weight strip are neighbouring programs (the program index runs
  over row tiles first), so the strip's second read hits the L2 cache;
- where the output has too few ``block_n`` strips to fill the SMs, ``split_k`` programs share a
  tile's K range: each writes its fp32 partial sum to a workspace and counts itself in on an
  atomic counter; the last one adds the partials in split order (deterministic), applies the
  scales, writes the output and resets the counter to 0 (so the kernel needs no zeroing launch
  and a CUDA graph replays it as it is);
- the activation tile is read from L2 by every weight strip, ``2 * block_m / block_n`` times the
  strip's weight bytes: wide strips (128, 256 rows) keep that L2 traffic below the HBM traffic
  at 64+ rows;
- block scales (128 x 128): a K step never crosses a scale block, so each step's fp32 partial
  product is scaled by one scalar (a tile inside one block row) or one per weight row (256-row
  tiles); channel scales multiply the finished sums once per output feature.

The result is ``x @ dequantize(W)^T`` up to the accumulation order, what ``gemm.
weight_only_matmul`` emulates; ``gemm`` checks the two agree once per device before using it.
The program mapping, the split-K hand-over and its workspace (kept for the process: a captured
graph holds their addresses) and the launch are ``decode_gemm_shared``'s, shared with the
W8A8-dynamic sibling ``dynamic_act_kernel``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from parallel_models.inference.fp8 import decode_gemm_shared as shared
from parallel_models.inference.fp8.decode_gemm_shared import (finish_tile, program_tile,
                                                              tile_pointers)
from parallel_models.inference.fp8.decode_tuning import DecodeConfig
from parallel_models.inference.fp8.quantize import BLOCK, QuantizedWeight
from parallel_models.llama.layers.exact import interpreter_fix

interpreter_fix.apply()  # (the CPU interpreter's loop bounds; nothing on the GPU)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # (no inline PTX there)
KERNEL = "weight_only"  # (its name in ``decode_tuning``'s keys)


# two fp16 values (exactly e4m3 values) -> two bf16 in one 32-bit word: sign kept, exponent and
# mantissa shifted right by 3 into bf16's places (that reads as the value times 2^-112: fp16's
# exponent bias is 15, bf16's 127), then one bf16x2 multiply by 2^112 (exact); e4m3 values are
# fp16 normals or 0, and their mantissas fit bf16's 7 bits
F16_TO_BF16_SHIFT, F16_TO_BF16_KEEP, SIGN_BITS = 3, 0x0FFF0FFF, 0x80008000
BF16_TWO_POW_112 = 0x7780
_F16_TO_BF16_ASM: tl.constexpr = tl.constexpr(f"""{{
.reg .b32 t, s, k, z;
shr.b32 t, $1, {F16_TO_BF16_SHIFT};
and.b32 t, t, {F16_TO_BF16_KEEP:#010x};
and.b32 s, $1, {SIGN_BITS:#010x};
or.b32 t, t, s;
mov.b32 k, {BF16_TWO_POW_112 << 16 | BF16_TWO_POW_112:#010x};
mov.b32 z, {SIGN_BITS:#010x};
fma.rn.bf16x2 $0, t, k, z;
}}""")


@triton.jit
def _e4m3_to_bf16(w):
    """e4m3 -> bf16 as e4m3 -> fp16 (one hardware conversion per two values) and fp16 -> bf16 by
    moving bits (integer ALU work, two values per 32-bit word). Triton's own e4m3 -> bf16 adds a
    conversion-unit instruction per value (F2F.BF16.F16), a unit that at the decode's weight
    bandwidth would be busy most of the time."""
    return tl.inline_asm_elementwise(_F16_TO_BF16_ASM, "=r,r", [w.to(tl.float16)],
                                     dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _w8a16_kernel(X, W, S, Y, P, C, M, N, K, stride_xm, stride_wn, stride_ym, stride_sn,
                  ws_rows, SPLIT_K, BLOCK_SCALES: tl.constexpr, EVEN_K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP: tl.constexpr, BIT_CONVERT: tl.constexpr):
    pid_m, pid_k, pid_n, num_m, k_begin, k_end = program_tile(M, K, SPLIT_K, BLOCK_M, BLOCK_K)
    rn, rm, n_ok, m_ok, w_ptrs, x_ptrs, scale_row = tile_pointers(
        X, W, S, M, N, pid_m, pid_n, k_begin, stride_xm, stride_wn, stride_sn, BLOCK_M, BLOCK_N,
        BLOCK_K, GROUP)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = k0 + rk < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        if BIT_CONVERT:
            w = _e4m3_to_bf16(w)
        else:
            w = w.to(x.dtype)
        if BLOCK_SCALES:
            if BLOCK_N <= GROUP:  # one scale per step: the tile lies inside one scale block
                acc += tl.dot(w, x) * tl.load(scale_row + k0 // GROUP)
            else:  # the tile spans block rows: a scale per weight row
                row_scales = tl.load(S + (rn // GROUP) * stride_sn + k0 // GROUP, mask=n_ok,
                                     other=0.0)
                acc += tl.dot(w, x) * row_scales[:, None]
        else:
            acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    finish_tile(acc, Y, S, P, C, rm, rn, n_ok, m_ok, pid_m, pid_k, pid_n, num_m, N, ws_rows,
                stride_ym, SPLIT_K, BLOCK_SCALES, BLOCK_N, BLOCK_M)


def launch(x2: torch.Tensor, weight: QuantizedWeight, y: torch.Tensor,
           cfg: DecodeConfig) -> torch.Tensor:
    """Run the kernel with ``cfg`` into ``y`` ``[rows, out]`` (``x2`` unit-strided along K);
    returns ``y``."""
    if weight.granularity == "block" and BLOCK % cfg.block_k:
        raise ValueError(f"fp8 decode GEMM: {cfg} crosses the 128 x 128 scale blocks")
    return shared.launch(_w8a16_kernel, x2, weight, y, cfg,
                         BIT_CONVERT=x2.dtype == torch.bfloat16 and not _INTERPRETED)


def weight_only_mm(x2: torch.Tensor, weight: QuantizedWeight,
                   config: DecodeConfig | None = None) -> torch.Tensor:
    """``x2 @ dequantize(W)^T`` for ``x2`` ``[rows, in]`` (CUDA: bf16/fp16; the interpreter:
    fp32 too), in ``x2``'s dtype; ``config``: these tiles (default: ``decode_tuning.choose``,
    which times the candidates on the first product of a new shape outside a graph capture)."""
    return shared.product(KERNEL, launch, x2, weight, config)


release_unused_workspaces = shared.release_unused_workspaces

__all__ = ["KERNEL", "launch", "release_unused_workspaces", "weight_only_mm"]
