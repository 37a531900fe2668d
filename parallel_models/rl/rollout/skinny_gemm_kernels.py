"""Triton kernel of the skinny decode GEMM ``y = x @ W^T`` (imported only through
``skinny_gemm``, which imports this module lazily: triton is not a dependency).

Program ``(m tile, K split, N tile)`` (one flat grid, the M tiles of one N tile and the splits
of one N tile launched next to each other) streams its ``[BLOCK_N, K / SPLIT_K]`` slab of W once
and multiplies it by the matching ``[BLOCK_M, K / SPLIT_K]`` slab of x, swapped (``W_tile @
x^T``: the big dimension N is the MMA's M side, the few rows of x its N side, so tensor cores
serve M = 1 .. 256 alike). fp32 accumulation, bf16 (x's dtype) out, transposed on the store.

``SPLIT_K > 1``: each split stores its fp32 tile in its slice of the workspace ``Ws`` and takes
a ticket from the tile's counter (``Locks``: a release after a CTA barrier, as CUTLASS's
split-K semaphore); the split that draws the last ticket sums the slices in split order (so the
result does not depend on which split finished last: the same bits every run, unlike atomic
adds), adds the bias, writes the bf16 output and resets the counter. No second kernel, and the
counters are zero again when the kernel ends, so a CUDA graph can replay it. See
``skinny_gemm`` for the contract and ``skinny_gemm_config`` for the launch settings.
"""

import os

import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's runtime loop bound (K_SPLIT)
    from parallel_models.llama.layers.exact import interpreter_fix

    interpreter_fix.apply()


@triton.jit
def _mma(w, xt, acc, UPCAST: tl.constexpr):
    """``acc + w @ xt`` in fp32. The CPU interpreter keeps bf16 as raw 16-bit integers (no
    products): there the tiles go to fp32 first (IEEE products; compiled kernels never do)."""
    if UPCAST:
        return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(w, xt, acc)


# the row count, split count and M tiles are runtime values (one compiled kernel serves every
# split: the sweep compiles a tile once for all shapes); only N, K and the strides get
# Triton's divisibility specialization (the vector loads and atomics need it)
@triton.jit(do_not_specialize_on_alignment=["M", "SPLIT_K", "M_TILES"])
def skinny_kernel(X, W, Bias, Y, Ws, Locks, M, N, K, SPLIT_K, K_SPLIT, M_TILES, stride_xm,
                  stride_wn, stride_ym, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                  EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    pid_m = pid % M_TILES
    pid_k = (pid // M_TILES) % SPLIT_K
    pid_n = pid // (M_TILES * SPLIT_K)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = n < N
    m_ok = m < M
    w_ptr = W + n.to(tl.int64)[:, None] * stride_wn + rk[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptr = X + m.to(tl.int64)[None, :] * stride_xm + rk[:, None]  # [BLOCK_K, BLOCK_M] (x^T)
    k_lo = pid_k * K_SPLIT
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        k = k_lo + k0
        if EVEN_K:  # every split a whole number of full K tiles: no K mask
            xt = tl.load(x_ptr + k, mask=m_ok[None, :], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptr + k)
            else:
                w = tl.load(w_ptr + k, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k + rk) < K
            xt = tl.load(x_ptr + k, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            w = tl.load(w_ptr + k, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _mma(w, xt, acc, UPCAST)
    out_mask = n_ok[:, None] & m_ok[None, :]
    y_ptr = Y + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=out_mask)
    else:
        # Ws [SPLIT_K, M, N] fp32: this split's partial sum, then a ticket
        part = Ws + (pid_k * M + m.to(tl.int64))[None, :] * N + n[:, None]
        tl.store(part, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's stores before the ticket (its release below)
        lock = Locks + pid_n * M_TILES + pid_m
        ticket = tl.atomic_add(lock, 1, sem="acq_rel")  # one per program
        if ticket == SPLIT_K - 1:  # the last split of this tile: every partial is written
            tl.debug_barrier()
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            first = Ws + m.to(tl.int64)[None, :] * N + n[:, None]
            for s in range(0, SPLIT_K):  # in split order, whichever split came last: the same
                total += tl.load(first + s * M * N, mask=out_mask, other=0.0,  # sum every run
                                 cache_modifier=".cg")  # (from L2)
            if HAS_BIAS:
                total += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptr, total.to(Y.dtype.element_ty), mask=out_mask)
            tl.store(lock, 0)  # every ticket drawn: ready for the next call
