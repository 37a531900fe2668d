"""The FP8 rollout's MLP input at decode: the gate_up GEMM with SwiGLU and the e4m3 quantization
of its output in the epilogue, as one Triton kernel (CUDA, Hopper; imported lazily: triton is
not a dependency). Without it a decode step's MLP ran the gate_up GEMM, then a SwiGLU kernel
that read the ``[rows, 2I]`` product back and wrote ``silu(gate) * up`` with its per-token
e4m3 copy (``producer_kernels``): 4.4 us a layer for the 8B shape at 64 rows on an H100, plus
a launch.

A program takes ``BLOCK_N`` (64 or 128: ``tma_decode_kernel.SCALE_GROUPS``) intermediate
features: their gate rows and their up rows of the ``[gate; up]`` weight (two TMA loads, one
activation tile a K step, two fp32 accumulators), so it holds whole ``silu(gate) * up`` values.
Its epilogue:

- the GEMM's scales and rounding, as ``tma_decode_kernel`` finishes a tile: the fp32 sums times
  the token's scale, then the output feature's, rounded to the model's dtype;
- SwiGLU as ``producer_kernels`` computes it (``silu(gate)`` rounded, times ``up``, rounded);
  written to ``H`` ``[rows, I]`` (the MLP's activation, as the unfused path has it);
- the e4m3 copy of ``H``, left on it for the down GEMM, with one scale per token
  (``quantize_activation(h, "channel")``'s recipe) where the launch fits the GPU at once
  (:func:`token_scales`: at most one program per SM): each program adds its tokens' maxima to
  a per-token maximum by atomic max, and a grid-wide barrier (a launch counter) waits for all
  of them before any quantizes (:func:`_token_amax`). Otherwise one scale per token and
  ``BLOCK_N`` features (``quantize_activation(h, "block", group=BLOCK_N)``: a program's
  features are one group, so nothing crosses programs), which the down GEMM reads in
  ``tma_decode_kernel``'s group-scaled mode (a dot per group, scaled): 28.8 against 26.5 us
  for the 8B down GEMM at 64 rows on an H100, back to back in a graph (session 23,
  ``bench/fp8_gemm_graph_probe.py``).

So the result is ``swiglu(token_matmul(x, W_gate_up))`` up to the accumulation order, and its
copy what ``quantize_activation`` gives from that; ``fused_producers`` routes the
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
from parallel_models.inference.fp8.tma_decode_kernel import PROMOTE_EVERY, SCALE_GROUPS, part_dot
from parallel_models.llama.layers.exact import interpreter_fix

interpreter_fix.apply()  # (the CPU interpreter's loop bounds; nothing on the GPU)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL = "tma_swiglu"  # (its name in ``decode_tuning``'s keys)
TOKEN_SCALES_ENV = "PARALLEL_MODELS_FP8_SWIGLU_TOKEN_SCALES"
_sync: dict = {}  # (device, programs, row bucket) -> (launch counter, per-token maxima)


@triton.jit
def _scaled_product(acc, token_scale, S, cols, OUT_DTYPE: tl.constexpr):
    """A ``[BLOCK_M, BLOCK_N]`` tile of fp32 sums times its tokens' and features' scales,
    rounded to ``OUT_DTYPE`` (the GEMM's output), as fp32."""
    acc = acc * token_scale[:, None]
    return (acc * tl.load(S + cols)[None, :]).to(OUT_DTYPE).to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _gate_up_swiglu_kernel(x_desc, w_desc, W, XS, S, H, Q, QS, SYNC, AMAX, M, inter, K, stride_w,
                           stride_h, stride_q, stride_qs, stride_amax, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr,
                           EMULATE: tl.constexpr, TOKENS_FIRST: tl.constexpr,
                           FP8_MAX: tl.constexpr, PDL: tl.constexpr, LINES: tl.constexpr = 0,
                           TOKEN_SCALES: tl.constexpr = False):
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
    if TOKEN_SCALES:  # (the launches before this one are done: SYNC counts whole launches)
        epoch = tl.atomic_add(SYNC, 0) // tl.num_programs(0)
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
    amax = tl.max(tl.abs(values), axis=1)
    q_offs = rm[:, None].to(tl.int64) * stride_q + rn[None, :]
    if TOKEN_SCALES:
        amax = _token_amax(amax, epoch, SYNC, AMAX, rm, m_ok, stride_amax)
        scale = e4m3_scale(amax, FP8_MAX)
        if pid_n == 0:
            tl.store(QS + rm, scale, mask=m_ok)
    else:
        scale = e4m3_scale(amax, FP8_MAX)
        tl.store(QS + rm.to(tl.int64) * stride_qs + pid_n, scale, mask=m_ok)
    q = scaled_for_e4m3(values, scale[:, None], FP8_MAX, EMULATE)
    tl.store(Q + q_offs, q.to(Q.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _token_amax(amax, epoch, SYNC, AMAX, rm, m_ok, stride_amax):
    """Each token's absolute maximum over the whole ``[rows, I]`` output: every program adds its
    own (``amax``, over its features) to ``AMAX[epoch % 2]`` by atomic max, counts itself in
    ``SYNC`` and waits until the launch's programs all have (a grid-wide barrier: the launch
    must fit on the GPU at once, see :func:`token_scales`); the first program zeroes the other
    half of ``AMAX`` for the next launch (the one before is done with it)."""
    programs = tl.num_programs(0)
    row = AMAX + (epoch % 2) * stride_amax + rm
    tl.atomic_max(row, amax, mask=m_ok)
    tl.debug_barrier()  # (every thread's atomic before the program counts itself)
    tl.atomic_add(SYNC, 1)
    target = (epoch + 1) * programs
    arrived = tl.atomic_add(SYNC, 0)
    while arrived < target:
        arrived = tl.atomic_add(SYNC, 0)
    tl.debug_barrier()
    total = tl.atomic_max(row, 0.0, mask=m_ok)  # (an atomic read: the value after every max)
    if tl.program_id(0) == 0:
        tl.store(AMAX + ((epoch + 1) % 2) * stride_amax + rm, 0.0, mask=m_ok)
    return total


def supports(x2: torch.Tensor, weight: QuantizedWeight) -> bool:
    """Whether the kernel takes ``x2`` times the ``[gate; up]`` ``weight``: channel scales,
    16-byte aligned rows, an intermediate size of whole 128-feature groups (so every config
    applies)."""
    two_inter = weight.shape[0]
    return weight.granularity == "channel" and two_inter % (2 * max(SCALE_GROUPS)) == 0 and \
        x2.shape[1] % 16 == 0 and weight.data.stride(0) % 16 == 0 and \
        weight.data.data_ptr() % 16 == 0


def token_scales(device: torch.device, programs: int) -> bool:
    """Whether a launch of ``programs`` programs on ``device`` quantizes its output per token
    (:func:`_token_amax`'s grid-wide barrier) rather than per program's features: on CUDA (not
    the interpreter, which runs programs one after another), at most one program per SM (so
    they all fit on the GPU at once whatever else runs), unless
    ``PARALLEL_MODELS_FP8_SWIGLU_TOKEN_SCALES=0``."""
    return device.type == "cuda" and not _INTERPRETED and \
        os.environ.get(TOKEN_SCALES_ENV, "1") != "0" and \
        programs <= decode_tuning.sm_count(device)


def _sync_workspace(device: torch.device, programs: int, rows: int):
    """(int64 launch counter ``[1]``, fp32 per-token maxima ``[2, bucket]``, zeroed) of
    :func:`_token_amax` for launches of ``programs`` programs and ``rows`` rows (the counter
    assumes every launch that shares it has that many programs)."""
    key = (str(device), programs, decode_tuning.row_bucket(rows))
    if key not in _sync:
        _sync[key] = (torch.zeros(1, dtype=torch.int64, device=device),
                      torch.zeros(2, key[2], dtype=torch.float32, device=device))
    return _sync[key]


def launch(x2: torch.Tensor, weight: QuantizedWeight, h: torch.Tensor, cfg: DecodeConfig,
           copy: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel with ``cfg`` (``block_n``: one of ``SCALE_GROUPS``): ``h`` ``[rows, I]``
    and ``copy`` (e4m3 ``[rows, I]``, fp32 scales: a flat buffer of at least ``rows x I / 64``)
    written; returns the copy as the down GEMM reads it: (e4m3, scales ``[rows]``) where
    :func:`token_scales`, else (e4m3, scales ``[rows, I / block_n]``)."""
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
    hq, flat_scales = copy
    x_desc = TensorDescriptor(q, [rows, inp], [q.stride(0), 1], [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor(weight.data, [2 * inter, inp], [weight.data.stride(0), 1],
                              [cfg.block_n, cfg.block_k])
    grid = -(-rows // cfg.block_m) * (inter // cfg.block_n)
    per_token = token_scales(x2.device, grid)
    if per_token:
        sync, amax = _sync_workspace(x2.device, grid, rows)
        hs = flat_scales[:rows]
    else:
        sync, amax = flat_scales, flat_scales  # (not read)
        hs = flat_scales[:rows * (inter // cfg.block_n)].view(rows, inter // cfg.block_n)
    _gate_up_swiglu_kernel[(grid,)](
        x_desc, w_desc, weight.data, scales, weight.scale, h, hq, hs, sync, amax, rows, inter,
        inp, weight.data.stride(0), h.stride(0), hq.stride(0), hs.stride(0),
        amax.stride(0) if per_token else 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, PROMOTE=PROMOTE_EVERY, EMULATE=_INTERPRETED,
        TOKENS_FIRST=cfg.tokens_first, FP8_MAX=E4M3_MAX,
        LINES=prefetch_lines(x2.device, 2 * cfg.block_n, inp), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, TOKEN_SCALES=per_token, **launch_options(x2.device))
    return hq, hs


def gate_up_swiglu(x2: torch.Tensor, weight: QuantizedWeight,
                   config: DecodeConfig | None = None) -> torch.Tensor:
    """``silu(gate) * up`` ``[rows, I]`` of ``x2`` ``[rows, in]`` (quantized per token, or its
    producer's copy) times the ``[gate; up]`` ``weight`` ``[2I, in]``, in ``x2``'s dtype, with its
    e4m3 copy left on it (``quantize.QUANTIZED_COPY``: per token, or per token and group, see
    :func:`launch`); ``config``: these tiles (default: ``decode_tuning.choose`` among this
    kernel's candidates)."""
    rows, inp = x2.shape
    inter = weight.shape[0] // 2
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    h = torch.empty(rows, inter, dtype=x2.dtype, device=x2.device)
    copy = (torch.empty(rows, inter, dtype=E4M3, device=x2.device),
            torch.empty(rows * (inter // min(SCALE_GROUPS)), dtype=torch.float32,
                        device=x2.device))  # (scales: as many as the smallest group needs)
    left = (copy[0], copy[1][:0].view(0, inter // max(SCALE_GROUPS)))  # (no rows: any)
    if rows:
        if config is None:
            config = decode_tuning.choose(rows, 2 * inter, inp, weight.granularity, x2.device,
                                          lambda cfg: launch(x2, weight, h, cfg, copy),
                                          kernel=KERNEL)
        left = launch(x2, weight, h, config, copy)
    setattr(h, QUANTIZED_COPY, left)
    return h


__all__ = ["KERNEL", "TOKEN_SCALES_ENV", "gate_up_swiglu", "launch", "supports", "token_scales"]
