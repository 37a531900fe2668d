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
- A tokens-first strip may also be one SM's share of the output features, any multiple of 16
  up to ``decode_tuning.MAX_STRIP`` (:func:`_w8a8_tma_strip_kernel`): its power-of-two parts
  (224 = 128 + 64 + 32) each get a weight descriptor, an accumulator and a dot on the same
  activation tile, so a wide linear runs one wave of programs that each read the activations
  once per K step (no K split). The tuner offers these; on an H100 the 8B gate_up's 224-row
  strips took 49.9 us against 48.6 us for 128-row tiles (session 20), so it passes them over.
- Activation scales per token, or per token and 64 or 128 inputs (``GROUP``: the copy the
  fused gate_up + SwiGLU kernel leaves, ``swiglu_gemm_kernel``): then a dot per group, its
  fp32 result times the group's scales before it is added (with 128-input groups
  ``gemm.dynamic_matmul``'s recipe).
- Launched with programmatic dependent launch on Hopper (``dependent_launch``); before it
  waits for the kernel before, a program asks L2 for the first lines of its weight rows
  (``dependent_launch.prefetch_weights``; not the strips of parts, which the tuner passes over).
- Accumulation: by default the tensor cores accumulate the whole K (or a K split's part) in
  the MMA's own accumulator, as CUTLASS's ``FP8FastAccum`` schedules (SGLang's per-token FP8
  GEMMs) do. Hopper's FP8 MMA adds in reduced precision; ``PARALLEL_MODELS_FP8_PROMOTE=128``
  promotes the sums to an fp32 accumulator every 128 inputs instead (``max_num_imprecise_acc``,
  as DeepSeek-V3 and cuBLAS's ``_scaled_mm`` do). On an H100 (docs/PERFORMANCE.md, session 25)
  promotion cost the 8B decode step 0.07-0.39 ms, and never promoting moved the error against
  exact arithmetic on the same e4m3 values from 0.28 % to 0.34 % of the mean output (gate_up,
  K 4096) and 0.14 % to 0.23-0.28 % (down, K 14336): bf16's output rounding is 0.2-0.4 %, the
  e4m3 inputs' several %. Group-scaled dots (one per group, then scaled) are promoted anyway.
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
from parallel_models.inference.fp8.decode_tuning import MAX_PARTS, DecodeConfig, strip_parts
from parallel_models.inference.fp8.dependent_launch import (launch_options, prefetch_lines,
                                                            prefetch_weights, release_dependents,
                                                            wait_for_inputs)
from parallel_models.inference.fp8.quantize import QUANTIZED_COPY, QuantizedWeight
from parallel_models.llama.layers.exact import interpreter_fix

interpreter_fix.apply()  # (the CPU interpreter's loop bounds; nothing on the GPU)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL = "tma"  # (its name in ``decode_tuning``'s keys)
PROMOTE_EVERY = 128  # the promotion interval where it is on; K steps are multiples of it
PROMOTE_ENV = "PARALLEL_MODELS_FP8_PROMOTE"  # 0 (default): never promote; 128: every 128 inputs
SCALE_GROUPS = (64, 128)  # inputs one activation scale may cover besides a whole token


def promote_every() -> int:
    """Inputs the FP8 MMA sums before an fp32 accumulator takes them, read at each launch (a
    CUDA graph keeps what its capture read) from ``PARALLEL_MODELS_FP8_PROMOTE``: ``0`` (the
    default) never, the whole K stays in the tensor cores' accumulator (see the module
    docstring); :data:`PROMOTE_EVERY` every 128 inputs."""
    text = os.environ.get(PROMOTE_ENV, "0")
    if text not in ("0", str(PROMOTE_EVERY)):
        raise ValueError(f"{PROMOTE_ENV}={text!r}: 0 (never) or {PROMOTE_EVERY}")
    return int(text)


@triton.jit
def part_dot(a, b, acc, PROMOTE: tl.constexpr, EMULATE: tl.constexpr):
    """``acc + a @ b^T`` on e4m3 tiles, both K-major (the interpreter: an fp32 dot of the exact
    e4m3 values), promoted to the fp32 accumulator every ``PROMOTE`` inputs (0: never)."""
    if EMULATE:
        return acc + tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
    elif PROMOTE == 0:  # (Triton's default on sm_90: the MMA's own accumulation throughout)
        return tl.dot(a, tl.trans(b), acc)
    else:
        return tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=PROMOTE)


@triton.jit
def _group_step(x_desc, w_desc, XS, acc, rm, m_ok, row0, n0, k, K, stride_xs,
                GROUP: tl.constexpr, PROMOTE: tl.constexpr, EMULATE: tl.constexpr,
                TOKENS_FIRST: tl.constexpr):
    """``acc`` plus the dot of the ``GROUP`` inputs from ``k`` on, times their tokens' scales
    (``XS[token, k // GROUP]``)."""
    w = w_desc.load([n0, k])
    x = x_desc.load([row0, k])
    group_scale = tl.load(XS + rm.to(tl.int64) * stride_xs + k // GROUP, mask=m_ok & (k < K),
                          other=0.0)
    if TOKENS_FIRST:
        part = part_dot(x, w, tl.zeros(acc.shape, dtype=tl.float32), PROMOTE, EMULATE)
        return acc + part * group_scale[:, None]
    else:
        part = part_dot(w, x, tl.zeros(acc.shape, dtype=tl.float32), PROMOTE, EMULATE)
        return acc + part * group_scale[None, :]


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _w8a8_tma_kernel(x_desc, w_desc, W, XS, S, Y, P, C, M, N, K, stride_w, stride_xs, stride_ym,
                     ws_rows, SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr, EMULATE: tl.constexpr,
                     TOKENS_FIRST: tl.constexpr, PDL: tl.constexpr, GROUP: tl.constexpr = 0,
                     LINES: tl.constexpr = 0):
    pid_m, pid_k, pid_n, num_m, k_begin, k_end = program_tile(M, K, SPLIT_K, BLOCK_M, BLOCK_K)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    prefetch_weights(W, rn, N, stride_w, k_begin, k_end, LINES)  # (weights: before the wait)
    wait_for_inputs(PDL)
    release_dependents(PDL)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = rn < N, rm < M
    if TOKENS_FIRST:  # the decode rows the MMA's long side, the weight rows its short one
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if GROUP:  # activation scales per token and GROUP inputs: a dot per group, then scaled
        for k in range(k_begin, k_end, BLOCK_K):
            for i in tl.static_range(BLOCK_K // GROUP):
                acc = _group_step(x_desc, w_desc, XS, acc, rm, m_ok, pid_m * BLOCK_M,
                                  pid_n * BLOCK_N, k + i * GROUP, K, stride_xs, GROUP, PROMOTE,
                                  EMULATE, TOKENS_FIRST)
    else:
        for k in range(k_begin, k_end, BLOCK_K):
            w = w_desc.load([pid_n * BLOCK_N, k])
            x = x_desc.load([pid_m * BLOCK_M, k])
            if TOKENS_FIRST:
                acc = part_dot(x, w, acc, PROMOTE, EMULATE)
            else:
                acc = part_dot(w, x, acc, PROMOTE, EMULATE)
        token_scale = tl.load(XS + rm, mask=m_ok, other=0.0)
        if TOKENS_FIRST:
            acc = acc * token_scale[:, None]
        else:
            acc = acc * token_scale[None, :]
    finish_tile(acc, Y, S, P, C, rm, rn, n_ok, m_ok, pid_m, pid_k, pid_n, num_m, N, ws_rows,
                stride_ym, SPLIT_K, False, BLOCK_N, BLOCK_M, TOKENS_FIRST)


@triton.jit
def _finish_part(acc, token_scale, first, Y, S, P, C, rm, m_ok, pid_m, pid_n, num_m, N,
                 stride_ym, WIDTH: tl.constexpr, BLOCK_M: tl.constexpr):
    """A ``[BLOCK_M, WIDTH]`` part of a strip (output features ``first`` on) to ``Y``: the token
    scales, then ``finish_tile`` (no K split)."""
    rn = first + tl.arange(0, WIDTH)
    finish_tile(acc * token_scale[:, None], Y, S, P, C, rm, rn, rn < N, m_ok, pid_m, 0, pid_n,
                num_m, N, 0, stride_ym, 1, False, WIDTH, BLOCK_M, True)


@triton.jit(do_not_specialize=["M"])
def _w8a8_tma_strip_kernel(x_desc, w_desc, w_desc2, w_desc3, w_desc4, XS, S, Y, P, C, M, N,
                           K, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr, EMULATE: tl.constexpr,
                           PARTS: tl.constexpr, BN2: tl.constexpr, BN3: tl.constexpr,
                           BN4: tl.constexpr, STRIP: tl.constexpr, PDL: tl.constexpr):
    """Tokens first, a strip of ``STRIP`` weight rows in ``PARTS`` (2-4) power-of-two parts
    (``BLOCK_N``, ``BN2``, ...), one activation tile per K step for all of them, no K split."""
    pid_m, _, pid_n, num_m, k_begin, k_end = program_tile(M, K, 1, BLOCK_M, BLOCK_K)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < M
    first = pid_n * STRIP
    wait_for_inputs(PDL)
    release_dependents(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BN2), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BN3), dtype=tl.float32)
    acc4 = tl.zeros((BLOCK_M, BN4), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        x = x_desc.load([pid_m * BLOCK_M, k])
        acc = part_dot(x, w_desc.load([first, k]), acc, PROMOTE, EMULATE)
        acc2 = part_dot(x, w_desc2.load([first + BLOCK_N, k]), acc2, PROMOTE, EMULATE)
        if PARTS > 2:
            acc3 = part_dot(x, w_desc3.load([first + BLOCK_N + BN2, k]), acc3, PROMOTE,
                             EMULATE)
        if PARTS > 3:
            acc4 = part_dot(x, w_desc4.load([first + BLOCK_N + BN2 + BN3, k]), acc4, PROMOTE,
                             EMULATE)
    token_scale = tl.load(XS + rm, mask=m_ok, other=0.0)
    _finish_part(acc, token_scale, first, Y, S, P, C, rm, m_ok, pid_m, pid_n, num_m, N,
                 stride_ym, BLOCK_N, BLOCK_M)
    _finish_part(acc2, token_scale, first + BLOCK_N, Y, S, P, C, rm, m_ok, pid_m, pid_n, num_m,
                 N, stride_ym, BN2, BLOCK_M)
    if PARTS > 2:
        _finish_part(acc3, token_scale, first + BLOCK_N + BN2, Y, S, P, C, rm, m_ok, pid_m,
                     pid_n, num_m, N, stride_ym, BN3, BLOCK_M)
    if PARTS > 3:
        _finish_part(acc4, token_scale, first + BLOCK_N + BN2 + BN3, Y, S, P, C, rm, m_ok,
                     pid_m, pid_n, num_m, N, stride_ym, BN4, BLOCK_M)


def strip_of_parts(cfg: DecodeConfig) -> bool:
    """Whether ``cfg`` runs :func:`_w8a8_tma_strip_kernel`: a tokens-first strip of several
    power-of-two parts."""
    return cfg.tokens_first and len(strip_parts(cfg.block_n)) > 1


def descriptor_blocks(cfg: DecodeConfig) -> list[tuple[int, int]]:
    """The weight descriptors' blocks (rows, block_k) of a launch with ``cfg``: one, or for a
    strip of parts one per part (:data:`~.decode_tuning.MAX_PARTS`; the absent ones repeat the
    first)."""
    if not strip_of_parts(cfg):
        return [(cfg.block_n, cfg.block_k)]
    parts = strip_parts(cfg.block_n)
    return [(rows, cfg.block_k) for rows in parts + (parts[0],) * (MAX_PARTS - len(parts))]


def part_constexprs(cfg: DecodeConfig) -> dict:
    """The strip kernel's constexprs naming a strip's parts (``BLOCK_N`` the first)."""
    parts = strip_parts(cfg.block_n)
    padded = parts + (16,) * (MAX_PARTS - len(parts))  # (absent parts: never touched)
    return {"BLOCK_N": padded[0], "PARTS": len(parts), "BN2": padded[1], "BN3": padded[2],
            "BN4": padded[3], "STRIP": cfg.block_n}


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
    """The e4m3 copy of ``x2`` and its scales, per token (``[rows]``) or per token and group of
    inputs (``[rows, in / group]``, :data:`SCALE_GROUPS`): the ones its producer left on it
    (see the module docstring), else quantized now per token (:func:`quantize_tokens`)."""
    left = getattr(x2, QUANTIZED_COPY, None)
    if left is not None and left[0].shape == x2.shape:
        return left
    return quantize_tokens(x2)


def _activations(x2: torch.Tensor, cfg: DecodeConfig) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(e4m3 activations, their scales, the inputs a scale covers: 0 per token) of a launch with
    ``cfg``: :func:`quantized_input`, the copy with group scales (groups of
    :data:`SCALE_GROUPS` inputs) only where the config's K step holds whole groups and it is
    no strip of parts (else quantized per token from ``x2``)."""
    q, scales = quantized_input(x2)
    if scales.dim() == 1:
        return q, scales, 0
    rows, inp = x2.shape
    groups = scales.shape[1]
    group = inp // groups if groups and inp % groups == 0 else 0
    if scales.shape[0] == rows and group in SCALE_GROUPS and cfg.block_k % group == 0 and \
            not strip_of_parts(cfg):
        return q, scales, group
    q, scales = quantize_tokens(x2)
    return q, scales, 0


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
    q, scales, group = _activations(x2, cfg)
    rows, inp = q.shape
    out = weight.shape[0]
    strip = strip_of_parts(cfg)
    if strip and cfg.split_k > 1:
        raise ValueError(f"fp8 TMA decode GEMM: {cfg}: a strip of several parts takes no K "
                         "split")
    step = group or cfg.block_k  # (the K extent of one tile load)
    x_desc = TensorDescriptor(q, [rows, inp], [q.stride(0), 1], [cfg.block_m, step])
    w_descs = [TensorDescriptor(weight.data, [out, inp], [weight.data.stride(0), 1],
                                [block_rows, step]) for block_rows, _ in descriptor_blocks(cfg)]
    if strip:
        partials, counters = shared.unused_pointers(x2.device)
        _w8a8_tma_strip_kernel[(cfg.grid(rows, out),)](
            x_desc, *w_descs, scales, weight.scale, y, partials, counters, rows, out, inp,
            y.stride(0), BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
            PROMOTE=promote_every(), EMULATE=_INTERPRETED, **part_constexprs(cfg),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x2.device))
        return y
    w_desc = w_descs[0]
    if cfg.split_k > 1:
        partials, counters = shared.workspace(x2.device, cfg.split_k, rows, out)
        ws_rows = partials.shape[1]
    else:  # (not read by the kernel: pointers of the right types)
        partials, counters = shared.unused_pointers(x2.device)
        ws_rows = 0
    k_span = -(-inp // (cfg.block_k * cfg.split_k)) * cfg.block_k
    promote = promote_every()
    _w8a8_tma_kernel[(cfg.grid(rows, out),)](
        x_desc, w_desc, weight.data, scales, weight.scale, y, partials, counters, rows, out,
        inp, weight.data.stride(0), scales.stride(0), y.stride(0), ws_rows, cfg.split_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PROMOTE=min(promote, group or promote),  # (a group's dot: at most its K)
        EMULATE=_INTERPRETED, TOKENS_FIRST=cfg.tokens_first, GROUP=group,
        LINES=prefetch_lines(x2.device, cfg.block_n, k_span),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x2.device))
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


__all__ = ["KERNEL", "PROMOTE_ENV", "PROMOTE_EVERY", "SCALE_GROUPS", "descriptor_blocks",
           "launch", "part_constexprs", "part_dot", "promote_every", "quantize_tokens",
           "quantized_input", "strip_of_parts", "supports", "tma_mm"]
