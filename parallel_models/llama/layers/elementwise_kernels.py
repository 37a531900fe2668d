"""Triton kernels of the training path's memory-bound elementwise ops: SwiGLU and RMSNorm
(plain and with the residual add), forward and backward (imported only through
``elementwise_triton``, which imports this module lazily: triton is not a dependency).

Every kernel reads each input element once and writes each output element once, math in fp32,
I/O in the tensors' dtypes, rounding where the eager reference (``fused_ops``) rounds:

- ``swiglu_fwd_kernel`` / ``swiglu_bwd_kernel``: program ``pid`` covers ``BLOCK`` columns of one
  row of the ``[rows, 2 * I]`` [gate; up] input; the backward writes d_gate and d_up into the two
  halves of one ``[rows, 2 * I]`` gradient (inductor's ``cat`` computes each output element on
  its own and so loads every input twice).
- ``rms_norm_fwd_kernel``: ``BLOCK_M`` whole rows per program (optionally adding the residual
  first and storing the sum); keeps each row's ``rstd`` (fp32) for the backward.
- ``rms_norm_bwd_kernel``: a fixed grid of programs walks the row tiles (tile ``pid``,
  ``pid + programs``, ...); each computes dx of its rows and adds ``dy * x_hat`` of them into
  one fp32 partial weight gradient, stored per program; the caller sums the partials (a
  ``[programs, N]`` float32 sum): dx and the weight gradient in one pass over x and dy.
"""

import triton
import triton.language as tl


@triton.jit
def _gate_up_block(GU, n_cols, stride_gu, col_blocks, BLOCK: tl.constexpr):
    """This program's row and ``BLOCK`` columns of ``[gate | up]``: (row, cols, mask, gate in its
    dtype, up in fp32)."""
    pid = tl.program_id(0)
    row = (pid // col_blocks).to(tl.int64)
    cols = (pid % col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    base = GU + row * stride_gu
    gate = tl.load(base + cols, mask=mask, other=0.0)
    up = tl.load(base + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    return row, cols, mask, gate, up


@triton.jit
def swiglu_fwd_kernel(GU, Out, n_cols, stride_gu, stride_out, col_blocks, BLOCK: tl.constexpr):
    """``out[r, c] = round(silu(gate[r, c])) * up[r, c]`` (eager rounds silu's output to the
    input dtype before the product; so does this)."""
    row, cols, mask, gate, up = _gate_up_block(GU, n_cols, stride_gu, col_blocks, BLOCK)
    g = gate.to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(gate.dtype).to(tl.float32)
    tl.store(Out + row * stride_out + cols, (silu * up).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(GU, DOut, DGU, n_cols, stride_gu, stride_dout, stride_dgu, col_blocks,
                      BLOCK: tl.constexpr):
    """``d_up = dout * round(silu(gate))``, ``d_gate = round(dout * up) * silu'(gate)`` with
    ``silu'(x) = s (1 + x (1 - s))``, ``s = sigmoid(x)`` (PyTorch's ``silu_backward``), written
    to ``DGU[r, :I]`` and ``DGU[r, I:]``."""
    row, cols, mask, gate, up = _gate_up_block(GU, n_cols, stride_gu, col_blocks, BLOCK)
    dout = tl.load(DOut + row * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    s = tl.sigmoid(g)
    silu = (g * s).to(gate.dtype).to(tl.float32)
    d_silu = (dout * up).to(gate.dtype).to(tl.float32)
    d_gate = d_silu * (s * (1.0 + g * (1.0 - s)))
    d_up = dout * silu
    out = DGU + row * stride_dgu
    tl.store(out + cols, d_gate.to(DGU.dtype.element_ty), mask=mask)
    tl.store(out + n_cols + cols, d_up.to(DGU.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_fwd_kernel(X, Res, Total, W, Y, Rstd, n_rows, N, stride_x, stride_res, stride_total,
                        stride_y, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """``Y = W * round(x * rstd)``, ``rstd = 1 / sqrt(mean(x^2) + eps)`` over each row, x in
    fp32; with ``HAS_RESIDUAL`` x is ``round(X + Res)``, stored to ``Total`` (whose dtype is the
    rounding's). ``Rstd[row]`` gets the row's rstd."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(Res + r64 * stride_res + cols[None, :], mask=mask, other=0.0)
        total = (x + res.to(tl.float32)).to(Total.dtype.element_ty)
        tl.store(Total + r64 * stride_total + cols[None, :], total, mask=mask)
        x = total.to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / N + eps)
    h = (x * rstd[:, None]).to(Total.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(Y + r64 * stride_y + cols[None, :], (w[None, :] * h).to(Y.dtype.element_ty),
             mask=mask)
    tl.store(Rstd + rows, rstd, mask=row_mask)


@triton.jit
def rms_norm_bwd_kernel(X, W, Rstd, DY, DT, DX, DWPart, n_rows, N, stride_x, stride_dy,
                        stride_dt, stride_dx, HAS_DT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """For the rows of tiles ``pid, pid + programs, ...``: with ``x_hat = x * rstd`` (rounded to
    x's dtype as the forward did) and ``dh = dy * w``:
    ``dx = rstd * (dh - x_hat * mean(dh * x_hat))`` (+ ``DT``, the gradient that reached the
    residual sum ``x`` directly, with ``HAS_DT``), and ``DWPart[pid] = sum over the rows of
    dy * round(x_hat)``, in fp32."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    tiles = tl.cdiv(n_rows, BLOCK_M)
    for tile in range(pid, tiles, programs):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x_in = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
        x = x_in.to(tl.float32)
        dy = tl.load(DY + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
        x_hat = x * rstd[:, None]
        dw += tl.sum(dy * x_hat.to(x_in.dtype).to(tl.float32), axis=0)
        dh = dy * w[None, :]
        c = tl.sum(dh * x_hat, axis=1) / N
        dx = rstd[:, None] * (dh - x_hat * c[:, None])
        if HAS_DT:
            dx += tl.load(DT + r64 * stride_dt + cols[None, :], mask=mask,
                          other=0.0).to(tl.float32)
        tl.store(DX + r64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DWPart + pid.to(tl.int64) * N + cols, dw, mask=col_mask)
