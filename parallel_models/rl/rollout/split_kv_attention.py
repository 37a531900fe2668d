"""Split-KV (flash-decoding) attention of one decode token per row, straight from the KV pool.

Triton kernels for :class:`~parallel_models.rl.rollout.pool_cache.PoolKVCache` on CUDA: row
``i``'s keys/values sit at pool positions ``offsets[i] .. offsets[i] + used[i] - 1``, the last one
being the token decoded now (its k/v come in as ``k_new`` / ``v_new``).

- GQA-aware: one program handles ALL query heads of one KV head (padded to 16 rows for
  ``tl.dot``), so each KV byte is read from memory once (PyTorch's flash kernel reads it once per
  query head).
- Split-KV: program ``(row, kv head, split)`` covers positions ``split * split_size ..`` of its
  row; splits past the row's length do nothing. The grid is fixed by ``max_row_tokens`` (not by
  the lengths), so a CUDA graph captured once per bucket serves every later step; no host sync.
  A second small kernel merges the splits' partial outputs with their log-sum-exps (skipped when
  one split covers ``max_row_tokens``).
- The new token's k/v are written into the pool by the program whose split holds it, so the
  decode step needs no separate KV write (``index_copy_``) launches.

Triton is imported lazily (:func:`available`); without it the cache keeps PyTorch's kernels.
Set ``TRITON_INTERPRET=1`` before importing triton to run the kernels on the CPU (tests).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

DEFAULT_SPLIT = int(os.environ.get("PARALLEL_MODELS_DECODE_SPLIT", "128"))
_BLOCK_N = 64


@functools.cache
def available() -> bool:
    """True when triton imports (the kernels are compiled on first use)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken triton: PyTorch's kernels are used
        return False
    return True


@functools.cache
def supported(device: torch.device, dtype: torch.dtype, kv_heads: int, head_dim: int) -> bool:
    """Triton imports, ``head_dim`` suits the kernel, and the kernel matches SDPA (a few rows,
    several splits) on ``device`` in ``dtype``: checked once; a failure warns and returns False
    (the caller keeps PyTorch's kernels)."""
    if not available() or head_dim < 16 or head_dim & (head_dim - 1):
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        pool, rows, group = 300, 4, 2

        def rand(*shape):
            return torch.randn(*shape, device=device, dtype=dtype, generator=g)

        k_pool, v_pool = rand(pool, kv_heads, head_dim), rand(pool, kv_heads, head_dim)
        q, k_new, v_new = (rand(rows, kv_heads * group, head_dim), rand(rows, kv_heads, head_dim),
                           rand(rows, kv_heads, head_dim))
        offsets = torch.tensor([0, 10, 80, 200], device=device)
        used = torch.tensor([1, 64, 100, 33], device=device, dtype=torch.int32)
        ref = reference_decode(q, k_new, v_new, k_pool, v_pool, offsets, used, 0.1)
        got = split_kv_decode(q, k_new, v_new, k_pool, v_pool, offsets, used, 100, 0.1, split=32)
        err = (got.float() - ref.float()).abs().max().item()
        if not err < 5e-2:
            raise AssertionError(f"max error {err} vs SDPA")
    except Exception as exc:  # noqa: BLE001 - any failure: PyTorch's kernels instead
        warnings.warn(f"split-KV triton decode attention disabled: {type(exc).__name__}: {exc}")
        return False
    return True


def reference_decode(q, k_new, v_new, k_pool, v_pool, offsets, used, scale) -> torch.Tensor:
    """What :func:`split_kv_decode` computes, with SDPA row by row (host loop: tests only);
    writes ``k_new`` / ``v_new`` into the pools like it."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_pool.shape[1]
    for i, (start, n) in enumerate(zip(offsets.tolist(), used.tolist())):
        k_pool[start + n - 1], v_pool[start + n - 1] = k_new[i], v_new[i]
        keys = k_pool[start:start + n].transpose(0, 1).repeat_interleave(group, 0)
        values = v_pool[start:start + n].transpose(0, 1).repeat_interleave(group, 0)
        out[i] = torch.nn.functional.scaled_dot_product_attention(
            q[i][:, None], keys, values, scale=scale)[:, 0]
    return out


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(Q, KNew, VNew, KPool, VPool, Offsets, Used, Out, PartOut, PartLse, scale,
                     stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_pt, stride_ph,
                     stride_ob, stride_oh,
                     G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                     BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr,
                     H: tl.constexpr, IEEE: tl.constexpr):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        used = tl.load(Used + row).to(tl.int32)
        last = used - 1  # the position of the token decoded now (comes from KNew / VNew)
        start = split * SPLIT
        end = tl.minimum(start + SPLIT, used)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        gmask = g < G
        heads = kvh * G + g
        q = tl.load(Q + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0)
        offset = tl.load(Offsets + row).to(tl.int64)
        k_new = tl.load(KNew + row * stride_kb + kvh * stride_kh + d)
        v_new = tl.load(VNew + row * stride_vb + kvh * stride_vh + d)
        k_base = KPool + kvh * stride_ph
        v_base = VPool + kvh * stride_ph
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        # a fixed trip count (the interpreter cannot loop to a runtime bound); tiles past the
        # row's end are skipped by the branch, so an empty split reads nothing
        for tile in range(0, SPLIT // BLOCK_N):
            n0 = start + tile * BLOCK_N
            if n0 < end:
                pos = n0 + tl.arange(0, BLOCK_N)
                valid = pos < end
                in_pool = pos < last
                addr = (offset + pos.to(tl.int64))[:, None] * stride_pt + d[None, :]
                k = tl.load(k_base + addr, mask=in_pool[:, None], other=0.0)
                v = tl.load(v_base + addr, mask=in_pool[:, None], other=0.0)
                is_new = (pos == last)[:, None]
                k = tl.where(is_new, k_new[None, :], k)
                v = tl.where(is_new, v_new[None, :], v)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = tl.where(valid[None, :], s * scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the tile has a valid position
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                if IEEE:
                    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
        if (last >= start) & (last < start + SPLIT):  # this program owns the new token
            new_addr = (offset + last.to(tl.int64)) * stride_pt + d
            tl.store(k_base + new_addr, k_new)
            tl.store(v_base + new_addr, v_new)
        nonempty = start < used
        denom = tl.where(l_i > 0, l_i, 1.0)
        out = acc / denom[:, None]
        if NUM_SPLITS == 1:
            tl.store(Out + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     out.to(Out.dtype.element_ty), mask=gmask[:, None] & nonempty)
        else:
            part = (row * H + heads) * NUM_SPLITS + split  # PartLse [B, H, S], PartOut [.., D]
            tl.store(PartOut + part[:, None] * D + d[None, :], out,
                     mask=gmask[:, None] & nonempty)
            tl.store(PartLse + part, m_i + tl.log(denom), mask=gmask & nonempty)

    @triton.jit
    def combine_kernel(PartOut, PartLse, Used, Out, stride_ob, stride_oh,
                       H: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                       NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        used = tl.load(Used + row).to(tl.int32)
        splits = (used + SPLIT - 1) // SPLIT
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, D)
        smask = s < splits
        base = (row * H + head) * NUM_SPLITS
        lse = tl.load(PartLse + base + s, mask=smask, other=float("-inf"))
        mx = tl.max(lse, 0)
        w = tl.where(smask, tl.exp(lse - mx), 0.0)
        parts = tl.load(PartOut + (base + s)[:, None] * D + d[None, :], mask=smask[:, None],
                        other=0.0)
        out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
        tl.store(Out + row * stride_ob + head * stride_oh + d, out.to(Out.dtype.element_ty))

    return triton, split_kernel, combine_kernel


def split_kv_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    k_pool: torch.Tensor, v_pool: torch.Tensor, offsets: torch.Tensor,
                    used: torch.Tensor, max_row_tokens: int, scale: float,
                    split: int = DEFAULT_SPLIT) -> torch.Tensor:
    """Attention of one query token per row over its pool region; writes ``k_new`` / ``v_new``
    at ``offsets + used - 1`` of the pools.

    ``q`` ``[B, heads, D]``; ``k_new`` / ``v_new`` ``[B, kv_heads, D]``; ``k_pool`` / ``v_pool``
    ``[positions, kv_heads, D]`` (one layer); ``offsets`` ``[B]`` region starts; ``used`` ``[B]``
    positions per row including the new one (>= 1, <= ``max_row_tokens``). -> ``[B, heads, D]``.
    """
    triton, split_kernel, combine_kernel = _kernels()
    b, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    if heads % kv_heads or dim & (dim - 1) or dim < 16:
        raise ValueError(f"split-KV decode needs heads ({heads}) a multiple of kv heads "
                         f"({kv_heads}) and a power-of-two head_dim >= 16 (got {dim})")
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new), ("k_pool", k_pool),
                    ("v_pool", v_pool)):
        if t.stride(-1) != 1:
            raise ValueError(f"split-KV decode needs {name} contiguous in head_dim")
    if k_pool.stride() != v_pool.stride():
        raise ValueError("split-KV decode needs the k and v pools laid out alike")
    if split < 16 or split & (split - 1):
        raise ValueError(f"split size must be a power of two >= 16, got {split}")
    block_n = min(_BLOCK_N, split)
    group = heads // kv_heads
    num_splits = triton.cdiv(max(int(max_row_tokens), 1), split)
    out = torch.empty_like(q)
    if num_splits > 1:
        part_out = torch.empty(b, heads, num_splits, dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(b, heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    split_kernel[(b, kv_heads, num_splits)](
        q, k_new, v_new, k_pool, v_pool, offsets, used, out, part_out, part_lse, scale,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1), k_pool.stride(0),
        k_pool.stride(1), out.stride(0), out.stride(1),
        G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_N=block_n,
        SPLIT=split, NUM_SPLITS=num_splits, H=heads, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2)
    if num_splits > 1:
        combine_kernel[(b, heads)](part_out, part_lse, used, out, out.stride(0), out.stride(1),
                                   H=heads, D=dim, SPLIT=split, NUM_SPLITS=num_splits,
                                   BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
                                   num_warps=4)
    return out


__all__ = ["DEFAULT_SPLIT", "available", "reference_decode", "split_kv_decode", "supported"]
