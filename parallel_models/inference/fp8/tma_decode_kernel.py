"""The FP8 rollout's W8A8 decode GEMM with tensor-memory-accelerator loads: ``y = x @ W^T`` with
``W`` in e4m3 with channel scales and ``x`` in e4m3 with per-token scales (``_scaled_mm``'s
row-wise recipe: the prefill's), as one Triton kernel (CUDA, Hopper; imported lazily: triton is
not a dependency).

Why: Nsight Compute on an H100/H200 (docs/PERFORMANCE.md, issue 37) showed the pointer-based
decode kernels (``weight_only_kernel``, ``dynamic_act_kernel``) issue-bound: an instruction every
3.4-7 cycles per warp for the address arithmetic, the masks and (weight-only) the e4m3 -> bf16
conversion, where cuBLAS's bf16 GEMM waits on memory (32 cycles). Here both tiles come in by TMA
(``TensorDescriptor``: one instruction per tile, out-of-range rows and columns zero-filled, no
masks), and both operands of the tensor-core dot are e4m3 as loaded: the K loop is the loads'
wait and the wgmma.

- Tiles, the program mapping and the split-K hand-over are ``decode_gemm_shared``'s (a
  :class:`~parallel_models.inference.fp8.decode_tuning.DecodeConfig`, tuned per shape by
  ``decode_tuning.choose`` among this kernel's candidates); the weight tile ``[block_n,
  block_k]`` is the dot's first operand and the activations ``[block_m, block_k]``, transposed
  in shared memory, its second (the MMA's long side the weight rows, its short side the decode
  rows; both K-major, as Hopper's FP8 MMA needs). ``tokens_first`` configs swap the two (the
  MMA's 64-long side the decode rows): a program may then take 16 or 32 weight rows, so a
  small linear fills the SMs with whole-K strips instead of K splits (the 8B o_proj at 64 rows:
  12.96 us with 16-row strips against 14.27 us, docs/PERFORMANCE.md session 19).
- Accumulation: Hopper's FP8 MMA adds in reduced precision, so the product is promoted to the
  fp32 accumulator every 128 inputs (``max_num_imprecise_acc``), as DeepSeek-V3 and cuBLAS do.
- Scales: the finished fp32 sums times the token's scale (before the split-K hand-over: the
  partials are linear in it) and the output feature's scale (``finish_tile``).
- The activations come quantized: by ``act_quant_kernel.quantize_tokens`` (one launch) or by
  the kernel that produced them (``fp8.fused_producers``: RMSNorm, SwiGLU), which leaves the
  e4m3 copy on its output (:func:`quantized_input`).

The result is ``gemm.emulated_matmul(x, W)`` with channel scales (``quantize_activation(x,
"channel")``) up to the accumulation order; ``gemm`` checks the two agree once per device before
using it. TMA needs 16-byte aligned rows: ``in`` a multiple of 16 (:func:`supports`). In
Triton's CPU interpreter the dot is an fp32 one of the exact e4m3 values.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from parallel_models.inference.fp8 import act_quant_kernel
from parallel_models.inference.fp8 import decode_gemm_shared as shared
from parallel_models.inference.fp8.decode_gemm_shared import finish_tile, program_tile
from parallel_models.inference.fp8.decode_tuning import DecodeConfig
from parallel_models.inference.fp8.quantize import QUANTIZED_COPY, QuantizedWeight
from parallel_models.llama.layers.exact import interpreter_fix

interpreter_fix.apply()  # (the CPU interpreter's loop bounds; nothing on the GPU)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL = "tma"  # (its name in ``decode_tuning``'s keys)
PROMOTE_EVERY = 128  # inputs the FP8 MMA sums in its own precision before the fp32 accumulator


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _w8a8_tma_kernel(x_desc, w_desc, XS, S, Y, P, C, M, N, K, stride_ym, ws_rows, SPLIT_K,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PROMOTE: tl.constexpr, EMULATE: tl.constexpr, TOKENS_FIRST: tl.constexpr):
    pid_m, pid_k, pid_n, num_m, k_begin, k_end = program_tile(M, K, SPLIT_K, BLOCK_M, BLOCK_K)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = rn < N, rm < M
    if TOKENS_FIRST:  # the decode rows the MMA's long side, the weight rows its short one
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        w = w_desc.load([pid_n * BLOCK_N, k])
        x = x_desc.load([pid_m * BLOCK_M, k])
        if TOKENS_FIRST:
            if EMULATE:  # (the interpreter: an fp32 dot of the exact e4m3 values)
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
            else:
                acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=PROMOTE)
        else:
            if EMULATE:
                acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)))
            else:
                acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE)
    token_scale = tl.load(XS + rm, mask=m_ok, other=0.0)
    if TOKENS_FIRST:
        acc = acc * token_scale[:, None]
    else:
        acc = acc * token_scale[None, :]
    finish_tile(acc, Y, S, P, C, rm, rn, n_ok, m_ok, pid_m, pid_k, pid_n, num_m, N, ws_rows,
                stride_ym, SPLIT_K, False, BLOCK_N, BLOCK_M, TOKENS_FIRST)


def supports(x2: torch.Tensor, weight: QuantizedWeight) -> bool:
    """Whether this kernel takes the product: channel scales, 16-byte aligned rows."""
    return weight.granularity == "channel" and x2.shape[1] % 16 == 0 and \
        weight.data.stride(0) % 16 == 0 and weight.data.data_ptr() % 16 == 0


def quantize_tokens(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2`` per token -> (e4m3 ``[rows, in]``, fp32 scales ``[rows]``): one launch of
    ``act_quant_kernel.quantize_tokens`` (the interpreter runs it too)."""
    q, s = act_quant_kernel.quantize_tokens(x2)
    return q, s.view(-1)


def quantized_input(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The e4m3 copy and per-token scales of ``x2``: the ones its producer left on it (see the
    module docstring), else quantized now (:func:`quantize_tokens`)."""
    left = getattr(x2, QUANTIZED_COPY, None)
    if left is not None and left[0].shape == x2.shape:
        return left
    return quantize_tokens(x2)


def launch(x2: torch.Tensor, weight: QuantizedWeight, y: torch.Tensor,
           cfg: DecodeConfig) -> torch.Tensor:
    """Run the kernel with ``cfg`` into ``y`` ``[rows, out]``; returns ``y``."""
    if not supports(x2, weight):
        raise ValueError(f"fp8 TMA decode GEMM: a {weight.granularity}-scaled "
                         f"{tuple(weight.shape)} weight with {x2.shape[1]} inputs; it takes "
                         "channel scales and inputs in multiples of 16")
    if cfg.block_k % PROMOTE_EVERY:
        raise ValueError(f"fp8 TMA decode GEMM: {cfg}: block_k must be a multiple of "
                         f"{PROMOTE_EVERY}")
    q, scales = quantized_input(x2)
    rows, inp = q.shape
    out = weight.shape[0]
    x_desc = TensorDescriptor(q, [rows, inp], [q.stride(0), 1], [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor(weight.data, [out, inp], [weight.data.stride(0), 1],
                              [cfg.block_n, cfg.block_k])
    if cfg.split_k > 1:
        partials, counters = shared.workspace(x2.device, cfg.split_k, rows, out)
        ws_rows = partials.shape[1]
    else:  # (not read by the kernel: pointers of the right types)
        partials, counters = shared.unused_pointers(x2.device)
        ws_rows = 0
    _w8a8_tma_kernel[(cfg.grid(rows, out),)](
        x_desc, w_desc, scales, weight.scale, y, partials, counters, rows, out, inp, y.stride(0),
        ws_rows, cfg.split_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PROMOTE=PROMOTE_EVERY, EMULATE=_INTERPRETED, TOKENS_FIRST=cfg.tokens_first,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return y


def tma_mm(x2: torch.Tensor, weight: QuantizedWeight,
           config: DecodeConfig | None = None) -> torch.Tensor:
    """``x2`` ``[rows, in]`` (CUDA: bf16/fp16; the interpreter: fp32 too) quantized per token,
    times ``dequantize(W)^T``, in ``x2``'s dtype; ``config``: these tiles (default:
    ``decode_tuning.choose`` among this kernel's candidates). A product it does not take
    (:func:`supports`: block scales, unaligned rows) runs the weight-only kernel."""
    if not supports(x2, weight):
        from parallel_models.inference.fp8.weight_only_kernel import weight_only_mm
        return weight_only_mm(x2, weight)
    return shared.product(KERNEL, launch, x2, weight, config)


__all__ = ["KERNEL", "PROMOTE_EVERY", "launch", "quantize_tokens", "quantized_input",
           "supports", "tma_mm"]
