"""The FP8 rollout's MLP input at decode: the gate_up GEMM with SwiGLU and the e4m3 quantization
of its output in the epilogue, as one Triton kernel (CUDA, Hopper; imported lazily: triton is
not a dependency). Without it a decode step's MLP ran the gate_up GEMM, then a SwiGLU kernel
that read the ``[rows, 2I]`` product back and wrote ``silu(gate) * up`` with its per-token
e4m3 copy (``producer_kernels``): 4.4 us a layer for the 8B shape at 64 rows on an H100, plus
a launch.

A program takes ``BLOCK_N`` (64 or 128: ``tma_decode_kernel.SCALE_GROUPS``) intermediate
features: their gate rows and their up rows of the ``[gate; up]`` weight (two TMA loads, one
activation tile a K step, two accumulators, summed as ``tma_decode_kernel``'s: in the tensor
cores unless ``tma_decode_kernel.promote_every`` says otherwise), so it holds whole
``silu(gate) * up`` values.
Its epilogue:

- the GEMM's scales and rounding, as ``tma_decode_kernel`` finishes a tile: the fp32 sums times
  the token's scale, then the output feature's, rounded to the model's dtype;
- SwiGLU as ``producer_kernels`` computes it (``silu(gate)`` rounded, times ``up``, rounded);
  written to ``H`` ``[rows, I]`` (the MLP's activation, as the unfused path has it);
- the e4m3 copy of ``H`` with one scale per token and ``BLOCK_N`` features (``quantize.
  quantize_activation(h, "block", group=BLOCK_N)``'s recipe: a program's features are one
  group, so no reduction crosses programs, which a per-token scale would need), left on ``H``
  for the down GEMM (``tma_decode_kernel``'s group-scaled mode: a dot per group, scaled).

The group is the tuned config's ``BLOCK_N``: 128-feature programs (256 weight rows) are fewer
than an H100's SMs for the 8B shape (112), 64-feature ones are not (224); on an H100 the
128-feature ones were faster all the same (49.2 against 52.5 us at 64 rows; the GEMM alone
took 48.6 us and the SwiGLU kernel after it 8.4 us, docs/PERFORMANCE.md session 20).

So the result is ``swiglu(token_matmul(x, W_gate_up))`` up to the accumulation order, and its
copy what ``quantize_activation(., "block", group)`` gives from that; ``fused_producers`` routes the
dense MLP's decode steps here. Configs (K step, warps, pipeline depth, which operand is the
MMA's long side) are tuned per shape by ``decode_tuning`` (kernel ``"tma_swiglu"``); no K split.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from parallel_models.inference.fp8 import decode_tuning, tma_decode_kernel
from parallel_models.inference.fp8.decode_tuning import DecodeConfig
from parallel_models.inference.fp8.dependent_launch import (launch_options, prefetch_lines,
                                                            prefetch_weights, release_dependents,
                                                            wait_for_inputs)
from parallel_models.inference.fp8.e4m3_rounding import e4m3_scale, scaled_for_e4m3
from parallel_models.inference.fp8.quantize import E4M3, E4M3_MAX, QUANTIZED_COPY, QuantizedWeight
from parallel_models.inference.fp8.tma_decode_kernel import (PROMOTE_EVERY, SCALE_GROUPS, part_dot,
                                                              promote_every)
from parallel_models.llama.layers.exact import interpreter_fix

interpreter_fix.apply()  # (the CPU interpreter's loop bounds; nothing on the GPU)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL = "tma_swiglu"  # (its name in ``decode_tuning``'s keys)


@triton.jit
def _scaled_product(acc, token_scale, S, cols, OUT_DTYPE: tl.constexpr):
    """A ``[BLOCK_M, BLOCK_N]`` tile of fp32 sums times its tokens' and features' scales,
    rounded to ``OUT_DTYPE`` (the GEMM's output), as fp32."""
    acc = acc * token_scale[:, None]
    return (acc * tl.load(S + cols)[None, :]).to(OUT_DTYPE).to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _gate_up_swiglu_kernel(x_desc, w_desc, W, XS, S, H, Q, QS, M, inter, K, stride_w, stride_h,
                           stride_q, stride_qs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr, EMULATE: tl.constexpr,
                           TOKENS_FIRST: tl.constexpr, FP8_MAX: tl.constexpr,
                           PDL: tl.constexpr, LINES: tl.constexpr = 0):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % num_m, pid // num_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # intermediate features (rows of the gate)
    m_ok = rm < M
    prefetch_weights(W, rn, inter, stride_w, 0, K, LINES)  # (weights: before the wait)
    prefetch_weights(W + inter.to(tl.int64) * stride_w, rn, inter, stride_w, 0, K, LINES)
    wait_for_inputs(PDL)
    release_dependents(PDL)
    if TOKENS_FIRST:
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc_gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros(acc_gate.shape, dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([pid_m * BLOCK_M, k])
        gate_w = w_desc.load([pid_n * BLOCK_N, k])
        up_w = w_desc.load([inter + pid_n * BLOCK_N, k])
        if TOKENS_FIRST:
            acc_gate = part_dot(x, gate_w, acc_gate, PROMOTE, EMULATE)
            acc_up = part_dot(x, up_w, acc_up, PROMOTE, EMULATE)
        else:
            acc_gate = part_dot(gate_w, x, acc_gate, PROMOTE, EMULATE)
            acc_up = part_dot(up_w, x, acc_up, PROMOTE, EMULATE)
    if not TOKENS_FIRST:  # (the epilogue works on [tokens, features])
        acc_gate = tl.trans(acc_gate)
        acc_up = tl.trans(acc_up)
    token_scale = tl.load(XS + rm, mask=m_ok, other=0.0)
    out_dtype: tl.constexpr = H.dtype.element_ty
    gate = _scaled_product(acc_gate, token_scale, S, rn, out_dtype)
    up = _scaled_product(acc_up, token_scale, S + inter, rn, out_dtype)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_dtype)
    h = (silu.to(tl.float32) * up).to(out_dtype)
    offs = rm[:, None].to(tl.int64) * stride_h + rn[None, :]
    tl.store(H + offs, h, mask=m_ok[:, None])
    values = tl.where(m_ok[:, None], h.to(tl.float32), 0.0)
    scale = e4m3_scale(tl.max(tl.abs(values), axis=1), FP8_MAX)
    q = scaled_for_e4m3(values, scale[:, None], FP8_MAX, EMULATE)
    q_offs = rm[:, None].to(tl.int64) * stride_q + rn[None, :]
    tl.store(Q + q_offs, q.to(Q.dtype.element_ty), mask=m_ok[:, None])
    tl.store(QS + rm.to(tl.int64) * stride_qs + pid_n, scale, mask=m_ok)


def supports(x2: torch.Tensor, weight: QuantizedWeight) -> bool:
    """Whether the kernel takes ``x2`` times the ``[gate; up]`` ``weight``: channel scales,
    16-byte aligned rows, an intermediate size of whole 128-feature groups (so every config
    applies)."""
    two_inter = weight.shape[0]
    return weight.granularity == "channel" and two_inter % (2 * max(SCALE_GROUPS)) == 0 and \
        x2.shape[1] % 16 == 0 and weight.data.stride(0) % 16 == 0 and \
        weight.data.data_ptr() % 16 == 0


def launch(x2: torch.Tensor, weight: QuantizedWeight, h: torch.Tensor, cfg: DecodeConfig,
           copy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Run the kernel with ``cfg`` (``block_n``: the group, one of ``SCALE_GROUPS``): ``h``
    ``[rows, I]`` and ``copy`` (e4m3 ``[rows, I]``, fp32 scales ``[rows, >= I / block_n]``: the
    first ``I / block_n`` columns) written; returns ``h``."""
    if not supports(x2, weight):
        raise ValueError(f"fp8 gate_up + SwiGLU decode GEMM: a {weight.granularity}-scaled "
                         f"{tuple(weight.shape)} weight with {x2.shape[1]} inputs; it takes "
                         "channel scales, inputs in multiples of 16 and an intermediate size "
                         f"in multiples of {max(SCALE_GROUPS)}")
    if cfg.block_n not in SCALE_GROUPS or cfg.split_k != 1 or cfg.block_k % PROMOTE_EVERY:
        raise ValueError(f"fp8 gate_up + SwiGLU decode GEMM: {cfg}: it takes {SCALE_GROUPS} "
                         f"features a program, no K split, K steps in multiples of "
                         f"{PROMOTE_EVERY}")
    q, scales = tma_decode_kernel.quantized_input(x2)
    if scales.dim() != 1:  # (a group-scaled copy: this kernel reads per-token scales)
        q, scales = tma_decode_kernel.quantize_tokens(x2)
    rows, inp = q.shape
    inter = weight.shape[0] // 2
    hq, hs = copy
    x_desc = TensorDescriptor(q, [rows, inp], [q.stride(0), 1], [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor(weight.data, [2 * inter, inp], [weight.data.stride(0), 1],
                              [cfg.block_n, cfg.block_k])
    grid = -(-rows // cfg.block_m) * (inter // cfg.block_n)
    _gate_up_swiglu_kernel[(grid,)](
        x_desc, w_desc, weight.data, scales, weight.scale, h, hq, hs, rows, inter, inp,
        weight.data.stride(0), h.stride(0), hq.stride(0), hs.stride(0), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PROMOTE=promote_every(),
        EMULATE=_INTERPRETED, TOKENS_FIRST=cfg.tokens_first, FP8_MAX=E4M3_MAX,
        LINES=prefetch_lines(x2.device, 2 * cfg.block_n, inp), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **launch_options(x2.device))
    return h


def gate_up_swiglu(x2: torch.Tensor, weight: QuantizedWeight,
                   config: DecodeConfig | None = None) -> torch.Tensor:
    """``silu(gate) * up`` ``[rows, I]`` of ``x2`` ``[rows, in]`` (quantized per token, or its
    producer's copy) times the ``[gate; up]`` ``weight`` ``[2I, in]``, in ``x2``'s dtype, with its
    group-scaled e4m3 copy left on it (``quantize.QUANTIZED_COPY``); ``config``: these tiles
    (default: ``decode_tuning.choose`` among this kernel's candidates)."""
    rows, inp = x2.shape
    inter = weight.shape[0] // 2
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    h = torch.empty(rows, inter, dtype=x2.dtype, device=x2.device)
    copy = (torch.empty(rows, inter, dtype=E4M3, device=x2.device),
            torch.empty(rows, inter // min(SCALE_GROUPS), dtype=torch.float32,
                        device=x2.device))  # (scales: as many as the smallest group needs)
    group = max(SCALE_GROUPS)  # (no rows: any)
    if rows:
        if config is None:
            config = decode_tuning.choose(rows, 2 * inter, inp, weight.granularity, x2.device,
                                          lambda cfg: launch(x2, weight, h, cfg, copy),
                                          kernel=KERNEL)
        launch(x2, weight, h, config, copy)
        group = config.block_n
    setattr(h, QUANTIZED_COPY, (copy[0], copy[1][:, :inter // group]))
    return h


__all__ = ["KERNEL", "gate_up_swiglu", "launch", "supports"]
