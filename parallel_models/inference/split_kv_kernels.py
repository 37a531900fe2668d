"""Triton kernels of the split-KV decode attention (imported only through
``split_kv_attention``, which imports this module lazily: triton is not a dependency).

``split_kernel``: program (row, KV head, split) runs an online softmax over its split's positions
for all query heads of the KV head; ``combine_kernel`` merges the splits by their log-sum-exps.
See ``split_kv_attention`` for the layout and the contract. ``FP8_KV``: e4m3 pools with fp32
scales per (position, KV head): a tile's scores are scaled by its keys' scales and its softmax
weights by its values' scales (fp32), and the new token is quantized as it is stored (in the
CPU interpreter, whose fp32 -> e4m3 conversion is wrong, rounded by
``fp8.e4m3_rounding.round_to_e4m3`` first). On Hopper both launch with programmatic
dependent launch (``fp8.dependent_launch``, switched by ``PARALLEL_MODELS_ATTENTION_PDL``):
each waits for the kernel before it before it reads or writes anything, so its launch
overlaps that kernel's end.
"""

import triton
import triton.language as tl

# (the interpreter's stand-in for the e4m3 conversion; the FP8 rollout's GEMM uses it alike)
from parallel_models.inference.fp8.e4m3_rounding import e4m3_scale, scaled_for_e4m3
# (programmatic dependent launch on Hopper: both kernels wait for the one before them first)
from parallel_models.inference.fp8.dependent_launch import release_dependents, wait_for_inputs

E4M3_MAX = tl.constexpr(448.0)  # e4m3's largest finite value


@triton.jit
def _tile(q, k_base, v_base, ks_base, vs_base, offset, n0, end, m_i, l_i, acc, scale,
          stride_pt, stride_st, d, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
          FP8_KV: tl.constexpr):
    """One tile of BLOCK_N pool positions from n0, below end (online softmax update of m_i,
    l_i, acc). The loads feed the dots directly, so the compiler can pipeline them. FP8_KV:
    e4m3 k / v (exact in q's dtype) and their scales at ``ks_base`` / ``vs_base``."""
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < end
    addr = (offset + pos.to(tl.int64))[:, None] * stride_pt + d[None, :]
    k = tl.load(k_base + addr, mask=valid[:, None], other=0.0)
    v = tl.load(v_base + addr, mask=valid[:, None], other=0.0)
    if FP8_KV:
        s_addr = (offset + pos.to(tl.int64)) * stride_st
        k_scale = tl.load(ks_base + s_addr, mask=valid, other=0.0)
        v_scale = tl.load(vs_base + s_addr, mask=valid, other=0.0)
        k = k.to(tl.float32).to(q.dtype)
        v = v.to(tl.float32).to(q.dtype)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if FP8_KV:
        s = s * k_scale[None, :]
    s = tl.where(valid[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the tile holds a valid position
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8_KV:
        p = p * v_scale[None, :]
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _rope(x, partner, cos, sin, sign):
    """RoPE ``x * cos + rotate_half(x) * sin`` with ``partner`` = x at ``(d + D/2) % D`` and
    ``sign`` = -1 below D/2 (rotate_half), in fp32, rounded to x's dtype once (as the compiled
    ``fused_ops.rotary``)."""
    out = x.to(tl.float32) * cos + sign * partner.to(tl.float32) * sin
    return out.to(x.dtype)


@triton.jit
def _store_quantized(base, scale_ptr, addr, x, INTERPRETED: tl.constexpr):
    """Store ``x`` [D] as e4m3 at ``base + addr`` and its fp32 scale (amax / 448, 1 for
    all-zero) at ``scale_ptr``, as ``pool_cache.quantize_kv``."""
    x = x.to(tl.float32)
    s = e4m3_scale(tl.max(tl.abs(x), 0), E4M3_MAX)
    scaled = scaled_for_e4m3(x, s, E4M3_MAX, INTERPRETED)  # (fp8.quantize's activation recipe)
    tl.store(base + addr, scaled.to(base.dtype.element_ty))
    tl.store(scale_ptr, s)


@triton.jit
def _one_token(q, k, v, m_i, l_i, acc, scale):
    """The online softmax update of one key / value (fp32 products, as a tile's)."""
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1) * scale
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new)
    return m_new, l_i * alpha + p, acc * alpha[:, None] + p[:, None] * v.to(tl.float32)[None, :]


@triton.jit
def _earlier_entry(q, KNew, VNew, Cos, Sin, src, kvh, m_i, l_i, acc, scale, stride_kb,
                   stride_kh, stride_vb, stride_vh, stride_cos, d, ROPE: tl.constexpr,
                   D: tl.constexpr):
    """Attend to the new k / v of entry ``src`` of this step (the same row's earlier token)."""
    k_ptr = KNew + src * stride_kb + kvh * stride_kh
    if ROPE:
        cos = tl.load(Cos + src * stride_cos + d).to(tl.float32)
        sin = tl.load(Sin + src * stride_cos + d).to(tl.float32)
        sign = tl.where(d < D // 2, -1.0, 1.0)
        k = _rope(tl.load(k_ptr + d), tl.load(k_ptr + (d + D // 2) % D), cos, sin, sign)
    else:
        k = tl.load(k_ptr + d)
    v = tl.load(VNew + src * stride_vb + kvh * stride_vh + d)
    return _one_token(q, k, v, m_i, l_i, acc, scale)


@triton.jit
def split_kernel(Q, KNew, VNew, KPool, VPool, Offsets, Used, Back, Out, PartOut, PartLse, Cos,
                 Sin, KScale, VScale, scale, stride_qb, stride_qh, stride_kb, stride_kh,
                 stride_vb, stride_vh, stride_pt, stride_ph, stride_ob, stride_oh, stride_cos,
                 stride_st, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 H: tl.constexpr, IEEE: tl.constexpr, RUNTIME_LOOP: tl.constexpr,
                 ROPE: tl.constexpr, MAX_BACK: tl.constexpr, FP8_KV: tl.constexpr,
                 INTERPRETED: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)  # (every read and write after it)
    release_dependents(PDL)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    used = tl.load(Used + row).to(tl.int32)
    last = used - 1  # the position of the token decoded now (comes from KNew / VNew)
    # positions first .. last - 1: the same row's earlier entries of this step (a fed re-entry),
    # read from KNew / VNew too (their programs write them into the pool concurrently)
    first = last - tl.load(Back + row).to(tl.int32)
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, used)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gmask = g < G
    heads = kvh * G + g
    offset = tl.load(Offsets + row).to(tl.int64)
    if ROPE:  # q and the new k rotated here (PARALLEL_MODELS_DECODE_FUSE_ROPE)
        cos = tl.load(Cos + row * stride_cos + d).to(tl.float32)
        sin = tl.load(Sin + row * stride_cos + d).to(tl.float32)
        d_partner = (d + D // 2) % D
        sign = tl.where(d < D // 2, -1.0, 1.0)
        q_ptr = Q + row * stride_qb + heads[:, None] * stride_qh
        q = _rope(tl.load(q_ptr + d[None, :], mask=gmask[:, None], other=0.0),
                  tl.load(q_ptr + d_partner[None, :], mask=gmask[:, None], other=0.0),
                  cos, sin, sign)
        k_ptr = KNew + row * stride_kb + kvh * stride_kh
        k_new = _rope(tl.load(k_ptr + d), tl.load(k_ptr + d_partner), cos, sin, sign)
    else:
        q = tl.load(Q + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0)
        k_new = tl.load(KNew + row * stride_kb + kvh * stride_kh + d)
    v_new = tl.load(VNew + row * stride_vb + kvh * stride_vh + d)
    k_base = KPool + kvh * stride_ph
    v_base = VPool + kvh * stride_ph
    ks_base = KScale + kvh  # (FP8_KV: the scales [positions, kv heads]; else unused)
    vs_base = VScale + kvh
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    pool_end = tl.minimum(end, first)  # positions before this step's come from the pool
    if RUNTIME_LOOP:  # compiled: loop to the split's end (the loads get pipelined)
        for n0 in range(start, pool_end, BLOCK_N):
            m_i, l_i, acc = _tile(q, k_base, v_base, ks_base, vs_base, offset, n0, pool_end,
                                  m_i, l_i, acc, scale, stride_pt, stride_st, d, BLOCK_N, IEEE,
                                  FP8_KV)
    else:  # the interpreter cannot loop to a runtime bound: a fixed trip count, tiles past the
        # split's end skipped (an empty split reads nothing)
        for tile in range(0, SPLIT // BLOCK_N):
            n0 = start + tile * BLOCK_N
            if n0 < pool_end:
                m_i, l_i, acc = _tile(q, k_base, v_base, ks_base, vs_base, offset, n0, pool_end,
                                      m_i, l_i, acc, scale, stride_pt, stride_st, d, BLOCK_N,
                                      IEEE, FP8_KV)
    lo = tl.maximum(first, start)
    hi = tl.minimum(last, end)
    if RUNTIME_LOOP:
        for pos in range(lo, hi):
            m_i, l_i, acc = _earlier_entry(q, KNew, VNew, Cos, Sin, row - (last - pos), kvh,
                                           m_i, l_i, acc, scale, stride_kb, stride_kh,
                                           stride_vb, stride_vh, stride_cos, d, ROPE, D)
    else:  # (the interpreter: a fixed trip count)
        for j in range(0, MAX_BACK):
            pos = lo + j
            if pos < hi:
                m_i, l_i, acc = _earlier_entry(q, KNew, VNew, Cos, Sin, row - (last - pos),
                                               kvh, m_i, l_i, acc, scale, stride_kb, stride_kh,
                                               stride_vb, stride_vh, stride_cos, d, ROPE, D)
    if (last >= start) & (last < start + SPLIT):  # this program owns the new token
        m_i, l_i, acc = _one_token(q, k_new, v_new, m_i, l_i, acc, scale)
        new_addr = (offset + last.to(tl.int64)) * stride_pt + d
        if FP8_KV:
            scale_addr = (offset + last.to(tl.int64)) * stride_st
            _store_quantized(k_base, ks_base + scale_addr, new_addr, k_new, INTERPRETED)
            _store_quantized(v_base, vs_base + scale_addr, new_addr, v_new, INTERPRETED)
        else:
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
                   NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    release_dependents(PDL)
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
