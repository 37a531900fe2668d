"""The one causal attention kernel of exact mode (Triton): prefill, decode and training run it.

A query at position ``p`` of its sequence attends to keys ``0..p``, read in blocks of
``BLOCK_N`` keys aligned at position 0 and taken in order with the online softmax (fp32 running
max, sum and accumulator). The arithmetic for one query is therefore fixed by its own position
and its sequence's keys: a decode step (one query per row, keys read from the KV cache) and a
packed training sequence (all queries, keys of the same tokens) compute the same bits for it.
Blocks past a query's own position (other queries of its tile reach further) are fully masked
and leave its running values unchanged exactly (max unchanged, scale ``exp(0) = 1``, adds 0).
One tile shape (``BLOCK_M`` queries x ``BLOCK_N`` keys, ``NUM_WARPS``) serves every call.

Queries ``[T, heads, d]`` are grouped into sequences: sequence ``s`` has queries
``q_start[s]:q_start[s+1]`` at positions ``pos0[s] + 0, 1, ...``, and its key ``j`` is row
``k_start[s] + j`` of ``k``/``v`` ``[S, kv_heads, d]`` (GQA: query head ``h`` reads KV head
``h // (heads / kv_heads)``).

Imported only when exact mode runs (Triton is optional): ``parallel_models.llama.layers.exact``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from parallel_models.llama.layers.exact import interpreter_fix

interpreter_fix.apply()

from parallel_models.llama.layers.exact import triton_matmul  # noqa: E402
from parallel_models.llama.layers.exact.triton_matmul import dot  # noqa: E402

BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = 64, 64, 4, 2


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, q_start_ptr, pos0_ptr, k_start_ptr, scale,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                      stride_ot, stride_oh, GROUP: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                      BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    block = tl.program_id(1)
    head = tl.program_id(2)
    q_lo = tl.load(q_start_ptr + seq)
    q_hi = tl.load(q_start_ptr + seq + 1)
    m0 = q_lo + block * BLOCK_M
    if m0 < q_hi:
        pos0 = tl.load(pos0_ptr + seq)
        k0 = tl.load(k_start_ptr + seq).to(tl.int64)
        kvh = head // GROUP
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_hi
        pos = pos0 + (rows - q_lo)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        keys = pos0 + tl.minimum(q_hi - m0, BLOCK_M) + (m0 - q_lo)  # last position + 1
        cols = tl.arange(0, BLOCK_N)
        for n0 in range(0, keys, BLOCK_N):
            kc = n0 + cols
            k_ok = kc < keys
            kt = tl.load(k_ptr + (k0 + kc)[None, :] * stride_kt + kvh * stride_kh + d[:, None],
                         mask=k_ok[None, :] & d_ok[:, None], other=0.0)
            s = dot(q, kt, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE, UPCAST) * scale
            s = tl.where(kc[None, :] <= pos[:, None], s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(v_ptr + (k0 + kc)[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                         mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            acc = dot(p.to(vt.dtype), vt, acc * alpha[:, None], IEEE, UPCAST)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + rows.to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: torch.Tensor,
              pos0: torch.Tensor, k_start: torch.Tensor, max_queries: int,
              scale: float | None = None) -> torch.Tensor:
    """Causal attention of ``q [T, heads, d]`` over ``k``/``v`` ``[S, kv_heads, d]`` grouped as
    the module doc says; ``max_queries`` bounds ``q_start``'s differences (the grid)."""
    t, heads, d = q.shape
    kv = k.shape[1]
    if heads % kv:
        raise ValueError(f"{heads} query heads are not a multiple of {kv} KV heads")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("exact attention needs the head dim contiguous")
    out = torch.empty_like(q)
    seqs = q_start.numel() - 1
    if t == 0 or seqs <= 0:
        return out
    scale = d ** -0.5 if scale is None else float(scale)
    grid = (seqs, triton.cdiv(max(int(max_queries), 1), BLOCK_M), heads)
    _attention_kernel[grid](
        q, k, v, out, q_start.to(torch.int32), pos0.to(torch.int32), k_start.to(torch.int32),
        scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), GROUP=heads // kv, D=d,
        BLOCK_D=max(triton.next_power_of_2(d), 16), IEEE=q.dtype == torch.float32,
        UPCAST=triton_matmul.UPCAST, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    return out
