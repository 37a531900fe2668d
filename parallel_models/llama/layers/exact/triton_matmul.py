"""Batch-invariant matrix products for exact mode (Triton): ``a @ b`` and the experts' grouped
product, each output row computed by one fixed tile program whatever the number of rows.

Why cuBLAS is not enough: it picks its kernel (tile shape, split-K, stream-K) from the problem
shape, so the same row is reduced in another order when the batch grows (a decode step of 3 rows
vs a packed training microbatch of 9000). Here the tile configuration depends only on the dtype
(``CONFIG``), there is no split-K, and K is walked from 0 upward in ``BLOCK_K`` steps with one
fp32 accumulator per output: row ``i`` of ``a @ b`` is the same sequence of MMA steps in every
call. The row count ``M`` is not specialized on (``do_not_specialize``), so one compiled kernel
serves every batch size.

Imported only when exact mode runs (Triton is optional): ``parallel_models.llama.layers.exact``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from parallel_models.llama.layers.exact import interpreter_fix

interpreter_fix.apply()

# dtype -> (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). One per dtype, never per shape.
CONFIG = {
    torch.bfloat16: (128, 128, 64, 8, 3),
    torch.float16: (128, 128, 64, 8, 3),
    torch.float32: (64, 64, 32, 4, 2),
}


# The CPU interpreter: it keeps bf16 as raw uint16 (no products), and its tl.dot is numpy's BLAS,
# whose result for a row depends on the row's place in the tile. There a tile product is an fp32
# broadcast multiply and a sum over K, the same for every row; compiled kernels never take it.
UPCAST = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in fp32: IEEE fp32 products for fp32 tiles, tensor-core default else."""
    if UPCAST:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _tile_product(a_ptr, b_ptr, rm, rn, m_end, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                  IEEE: tl.constexpr, UPCAST_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 ``[BLOCK_M, BLOCK_N]`` tile of ``a[rm] @ b[:, rn]`` (rows ``>= m_end`` read as
    0), K walked from 0 upward in ``BLOCK_K`` steps: the one tile loop of both kernels, so a row
    of the dense and of the grouped product is the same sequence of MMA steps."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=(rm[:, None] < m_end) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = dot(a, b, acc, IEEE, UPCAST_TILES)
    return acc


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                   stride_cm, stride_cn, IEEE: tl.constexpr, UPCAST_TILES: tl.constexpr,
                   BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # M * N may pass 2^31
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _tile_product(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk,
                        stride_bn, IEEE, UPCAST_TILES, BLOCK_M, BLOCK_N, BLOCK_K)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["R"])
def _grouped_kernel(a_ptr, b_ptr, c_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr, R, N, K, E,
                    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
                    IEEE: tl.constexpr, UPCAST_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)
    if e < E:
        row0 = tl.load(tile_row_ptr + tile)
        end = tl.load(ends_ptr + e)
        rm = row0 + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _tile_product(a_ptr, b_ptr + e.to(tl.int64) * stride_be, rm, rn, end, N, K,
                            stride_am, stride_ak, stride_bk, stride_bn, IEEE, UPCAST_TILES,
                            BLOCK_M, BLOCK_N, BLOCK_K)
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < end) & (rn[None, :] < N))


def _config(dtype: torch.dtype):
    if dtype not in CONFIG:
        raise TypeError(f"exact mode matmul supports {sorted(map(str, CONFIG))}, got {dtype}")
    return CONFIG[dtype]


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` (any strides) -> ``[M, N]`` in ``a``'s dtype."""
    M, K = a.shape
    N = b.shape[1]
    bm, bn, bk, warps, stages = _config(a.dtype)
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0:
        return c
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    _matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                         c.stride(0), c.stride(1), IEEE=a.dtype == torch.float32,
                         UPCAST_TILES=UPCAST,
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return c


def grouped_matmul(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``: rows ``offs[e-1]:offs[e]`` of ``a [R, K]`` times
    ``b[e] [K, N]``; ``offs`` int cumulative row ends per expert (on the device: no host sync, so
    a decode step stays capturable in a CUDA graph)."""
    R, K = a.shape
    E, _, N = b.shape
    bm, bn, bk, warps, stages = _config(a.dtype)
    c = torch.zeros((R, N), dtype=a.dtype, device=a.device)
    if R == 0:
        return c
    ends = offs.to(device=a.device, dtype=torch.long)
    counts = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (counts + bm - 1) // bm
    tile_end = torch.cumsum(tiles, 0)
    num_tiles = triton.cdiv(R, bm) + E  # >= sum(tiles): every expert's last tile may be partial
    t = torch.arange(num_tiles, device=a.device)
    expert = torch.searchsorted(tile_end, t, right=True)
    safe = expert.clamp(max=E - 1)
    first = tile_end[safe] - tiles[safe]
    row0 = (ends[safe] - counts[safe]) + (t - first) * bm
    grid = (num_tiles, triton.cdiv(N, bn))
    _grouped_kernel[grid](a, b, c, expert, row0, ends, R, N, K, E, a.stride(0), a.stride(1),
                          b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
                          IEEE=a.dtype == torch.float32, UPCAST_TILES=UPCAST, BLOCK_M=bm,
                          BLOCK_N=bn, BLOCK_K=bk,
                          num_warps=warps, num_stages=stages)
    return c
