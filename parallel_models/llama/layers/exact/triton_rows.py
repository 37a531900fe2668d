"""Batch-invariant row reductions for exact mode (Triton): RMSNorm, softmax over the last dim,
the log-prob of one token per row, and the MoE combine (sum of each token's expert outputs).

Each row is reduced by one program with a block size fixed by the row length alone (never by
the number of rows), in the same order in every call: a row gives the same bits whether it is
alone (a decode step) or one of thousands (a training microbatch). PyTorch's own reduction
kernels choose their strategy (threads per row, split across blocks) from the whole shape, and
the MoE combine's ``scatter_add_`` adds with atomics in whatever order the threads arrive.

A ``tl.sum`` adds each thread's elements first, so its order follows the register layout of the
loaded row, which Triton picks from what it knows of the pointers (alignment, divisibility of the
strides and lengths): the row strides (and the log-prob's vocab size, padded on the training side)
are therefore never specialized on, and callers pass the same dtype on both sides (the sampler
hands over the model's logits, not a float copy), so every call runs the same compiled kernel.
(The matmul and attention kernels reduce inside ``tl.dot``, whose layout the tile shape fixes.)

Imported only when exact mode runs (Triton is optional): ``parallel_models.llama.layers.exact``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from parallel_models.llama.layers.exact import interpreter_fix

interpreter_fix.apply()

VOCAB_BLOCK = 2048  # log-prob: the vocab is walked in blocks of this many ids, from id 0 up
COMBINE_BLOCK = 256  # combine: hidden columns per program


@triton.jit(do_not_specialize=["stride_x", "stride_y"])
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    h = (x * (1.0 / tl.sqrt(var + eps))).to(y_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * h.to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["stride_x", "stride_y"])
def _softmax_kernel(x_ptr, y_ptr, N, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    y = e / tl.sum(e, axis=0)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["V", "stride_x"])
def _token_log_prob_kernel(x_ptr, label_ptr, out_ptr, V, stride_x, temperature,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    cols = tl.arange(0, BLOCK)
    run_max = tl.full((BLOCK,), -float("inf"), tl.float32)
    for v0 in range(0, V, BLOCK):
        z = tl.load(base + v0 + cols, mask=v0 + cols < V, other=-float("inf")).to(tl.float32)
        run_max = tl.maximum(run_max, z / temperature)
    m = tl.max(run_max, axis=0)
    run_sum = tl.zeros((BLOCK,), tl.float32)
    for v0 in range(0, V, BLOCK):
        z = tl.load(base + v0 + cols, mask=v0 + cols < V, other=-float("inf")).to(tl.float32)
        run_sum += tl.exp(z / temperature - m)
    total = tl.sum(run_sum, axis=0)
    label = tl.load(label_ptr + row)
    zy = tl.load(base + label).to(tl.float32) / temperature
    tl.store(out_ptr + row, (zy - m) - tl.log(total))


@triton.jit(do_not_specialize=["stride_src", "stride_out"])
def _segment_sum_kernel(src_ptr, order_ptr, starts_ptr, base_ptr, out_ptr, H, stride_src,
                        stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    lo = tl.load(starts_ptr + row)
    hi = tl.load(starts_ptr + row + 1)
    acc = tl.load(base_ptr + row * stride_out + cols, mask=mask, other=0.0).to(tl.float32)
    for i in range(lo, hi):
        j = tl.load(order_ptr + i)
        acc += tl.load(src_ptr + j * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dim (fp32 stats)."""
    rows = _rows(x)
    n = rows.shape[1]
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight.contiguous(), out, n, rows.stride(0),
                                           out.stride(0), float(eps), BLOCK=block,
                                           num_warps=8 if block >= 2048 else 4)
    return out.view(*x.shape[:-1], n)


def softmax(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Softmax over the last dim (computed in fp32), output in ``dtype`` (default x's)."""
    rows = _rows(x)
    n = rows.shape[1]
    out = torch.empty(rows.shape, dtype=dtype or x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(n)
        _softmax_kernel[(rows.shape[0],)](rows, out, n, rows.stride(0), out.stride(0),
                                          BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return out.view(*x.shape[:-1], n)


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
                    ) -> torch.Tensor:
    """float32 ``log_softmax(logits.float() / temperature)[row, labels[row]]`` per row of
    ``logits [rows, V]``."""
    rows = _rows(logits)
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)
    if rows.shape[0]:
        labels = labels.reshape(-1).to(device=logits.device, dtype=torch.long).contiguous()
        _token_log_prob_kernel[(rows.shape[0],)](rows, labels, out, rows.shape[1], rows.stride(0),
                                                 float(temperature), BLOCK=VOCAB_BLOCK,
                                                 num_warps=8)
    return out.view(logits.shape[:-1])


def index_add_rows(base: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``base.index_add(0, index, source)`` for 2-D ``source``, out of place and deterministic:
    row ``r`` adds, in fp32, the source rows with ``index == r`` in their order in ``source``
    (for the MoE combine: a token's expert outputs in expert order, whatever else is batched)."""
    n, h = base.shape
    index = index.to(device=source.device, dtype=torch.long)
    order = torch.argsort(index, stable=True)
    starts = torch.searchsorted(index[order], torch.arange(n + 1, device=source.device))
    src = source if source.stride(-1) == 1 else source.contiguous()
    b = base.contiguous()
    out = torch.empty_like(b)
    if n:
        grid = (n, triton.cdiv(h, COMBINE_BLOCK))
        _segment_sum_kernel[grid](src, order, starts, b, out, h, src.stride(0), b.stride(0),
                                  BLOCK=COMBINE_BLOCK, num_warps=4)
    return out
