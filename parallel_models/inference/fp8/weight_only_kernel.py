"""The FP8 rollout's decode GEMM: ``y = x @ W^T`` with ``W`` in e4m3 (block or channel scales)
and ``x`` left in its 16-bit dtype (weight-only FP8, "W8A16"), as one Triton kernel (CUDA;
imported lazily: triton is not a dependency).

Why: a decode step is memory-bound, so what FP8 buys there is reading half the weight bytes. With
``torch._scaled_mm`` the activations must be quantized first (an extra kernel per linear) and
cuBLAS's block-scaled FP8 kernels are slow at 64-256 rows: measured on an H100 (docs/
PERFORMANCE.md, issue 37), W8A8 decode steps were 1.2-2x *slower* than bf16. Here each program
reads an ``[N-tile, K]`` strip of e4m3 weights once, converts each 128-wide K tile to the
activation dtype (exact: e4m3 fits in bf16/fp16), multiplies it with the activation tile on the
tensor cores, and scales the fp32 partial product by the tile's block scale (128 x 128 blocks:
one scalar per N-tile and K-tile, since the N-tile divides 128) or, for channel scales, the
finished row by the per-output scales. The result is ``x @ dequantize(W)^T`` up to the
accumulation order, so it matches the emulation in ``gemm.weight_only_matmul``.

``gemm`` uses it for the decode-sized products (few rows; prefill stays on ``_scaled_mm``) after
checking it against the emulation once per device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from parallel_models.inference.fp8.quantize import BLOCK, QuantizedWeight
from parallel_models.llama.layers.exact import interpreter_fix

interpreter_fix.apply()  # (the CPU interpreter's loop bounds; nothing on the GPU)


@triton.jit
def _w8a16_kernel(X, W, S, Y, M, N, K, stride_xm, stride_wn, stride_ym, stride_sn,
                  BLOCK_SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    scale_row = S + ((pid_n * BLOCK_N) // BLOCK_K) * stride_sn
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + rn[None, :].to(tl.int64) * stride_wn + kk[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        part = tl.dot(x, w.to(x.dtype))
        if BLOCK_SCALES:
            acc += part * tl.load(scale_row + k0 // BLOCK_K)
        else:
            acc += part
    if not BLOCK_SCALES:
        acc = acc * tl.load(S + rn, mask=n_ok, other=0.0)[None, :]
    tl.store(Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _tiles(rows: int, out: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): the row tile covers the decode batch in as few tiles as the tensor
    cores take (16..64); the column tile is 64, or 32 where 64 would leave SMs idle."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = 64 if out // 64 >= 132 else 32
    return block_m, block_n


def weight_only_mm(x2: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x2 @ dequantize(W)^T`` for ``x2`` ``[rows, in]`` (CUDA, bf16/fp16), in ``x2``'s dtype."""
    rows, inp = x2.shape
    out_features = weight.shape[0]
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(rows, out_features, dtype=x2.dtype, device=x2.device)
    if rows == 0:
        return y
    block_m, block_n = _tiles(rows, out_features)
    block = weight.granularity == "block"
    scale = weight.scale
    grid = (triton.cdiv(out_features, block_n), triton.cdiv(rows, block_m))
    _w8a16_kernel[grid](x2, weight.data, scale, y, rows, out_features, inp, x2.stride(0),
                        weight.data.stride(0), y.stride(0), scale.stride(0) if block else 0,
                        BLOCK_SCALES=block, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK,
                        num_warps=4, num_stages=4)
    return y


__all__ = ["weight_only_mm"]
