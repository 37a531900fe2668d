"""The FP8 rollout's W8A8-dynamic decode GEMM: ``y = x @ W^T`` with ``W`` in e4m3 (block or
channel scales) and ``x`` read in its 16-bit dtype and quantized to e4m3 *inside* the kernel, per
token and 128-wide group of the input features, as one Triton kernel (CUDA; imported lazily:
triton is not a dependency).

Why: the weight-only sibling (``weight_only_kernel``) converts every e4m3 weight to bf16 in
registers, ALU work per weight byte that kept it at 1.4 TB/s on an H100 (docs/PERFORMANCE.md,
issue 37). Here both operands of ``tl.dot`` are e4m3 (Hopper's native FP8 wgmma): the weights go
from memory to the tensor cores untouched, and the conversion work is the activations' (``block_m
/ block_n`` of an element per weight byte); quantizing in the kernel saves the separate
quantization launch that made ``_scaled_mm``'s W8A8 decode slow.

Numerics, the DeepSeek-V3 recipe of the prefill (``quantize.quantize_activation`` with
``"block"``, the 1 x 128 tiles ``_scaled_mm`` reads): per token and group ``scale = amax / 448``
(1 for an all-zero group), ``q = e4m3(clamp(x * (1 / scale)))`` (the reciprocal correctly
rounded, round to nearest even), so decode and prefill round the activations alike, whatever the
weight's granularity. (Until session 16 the recipe divided, ``x / scale``: bf16 activations land
on exact e4m3 ties in ~5 of 10^4 elements, which the division and the kernel's multiply round
apart, one e4m3 step; the GPU test found the outputs up to 6 % off.) Each group's product is its
own ``tl.dot`` (a fresh fp32 accumulator: Hopper's FP8 MMA accumulates in reduced precision, so
the sum is promoted to fp32 every 128 inputs, as DeepSeek-V3 does) and is added to the fp32
total times (activation group scale per row) x (the weight's block scale: one scalar for a tile
inside one block row, one per weight row for a 256-row tile); channel scales multiply the
finished sums once per output feature. The result is ``gemm.emulated_matmul(x, W,
act_groups="block")`` in fp32 (``gemm.dynamic_matmul``) up to the accumulation order; ``gemm``
checks the two agree once per device before using it.

Tiles as the weight-only kernel's (:class:`~parallel_models.inference.fp8.decode_tuning.
DecodeConfig`, chosen per shape by ``decode_tuning.choose`` among this kernel's candidates): the
weight tile ``[block_n, 128]`` is the dot's first operand and the quantized activations
``[128, block_m]`` the second (the MMA's long side the weight rows, its short side the decode
rows); ``block_k`` is 128 or 256 (one or two groups per pipelined step: the same bytes as 64-128
bf16 weights); the program mapping, the split-K hand-over and its workspace and the launch are
``decode_gemm_shared``'s.

Triton's CPU interpreter converts fp32 -> e4m3 wrongly (no carry into the exponent, subnormals
cut): there (``_INTERPRETED``) the kernel rounds to e4m3 values itself
(``e4m3_rounding.round_to_e4m3``, integer ops on the fp32 bits) and takes an fp32 dot of those
exact e4m3 values, so the interpreter checks the quantization logic, the scales and the
reduction; the GPU's e4m3 dot is checked by ``gemm``'s device check and ``tests/gpu``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from parallel_models.inference.fp8 import decode_gemm_shared as shared
from parallel_models.inference.fp8.decode_gemm_shared import (finish_tile, program_tile,
                                                              tile_pointers)
from parallel_models.inference.fp8.decode_tuning import DecodeConfig
from parallel_models.inference.fp8.e4m3_rounding import e4m3_scale, round_to_e4m3
from parallel_models.inference.fp8.quantize import (BLOCK, E4M3_MAX, QuantizedWeight,
                                                    quantize_activation)
from parallel_models.llama.layers.exact import interpreter_fix

interpreter_fix.apply()  # (the CPU interpreter's loop bounds; nothing on the GPU)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL = "dynamic"  # (its name in ``decode_tuning``'s keys)
KERNEL_PREQUANT = "w8a8"  # the same GEMM on activations quantized beforehand

@triton.jit
def _group_product(w, x, EMULATE: tl.constexpr, FP8_MAX: tl.constexpr):
    """``w`` ``[BLOCK_N, 128]`` e4m3 times ``x`` ``[128, BLOCK_M]`` quantized per column (token)
    -> (fp32 ``[BLOCK_N, BLOCK_M]`` product of the e4m3 values, the tokens' scales
    ``[BLOCK_M]``)."""
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = e4m3_scale(amax, FP8_MAX)
    scaled = x * tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[None, :]
    if EMULATE:  # (the interpreter: exact e4m3 values in fp32, an fp32 dot)
        scaled = tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX)
        return tl.dot(w.to(tl.float32), round_to_e4m3(scaled)), scale
    # the GPU's conversion saturates (cvt.rn.satfinite): |x * (1 / scale)| exceeds 448 by at
    # most an ulp, which rounds to 448 as the clamp would
    return tl.dot(w, scaled.to(tl.float8e4nv)), scale


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _w8a8_dynamic_kernel(X, W, S, Y, P, C, M, N, K, stride_xm, stride_wn, stride_ym, stride_sn,
                         ws_rows, SPLIT_K, XS, stride_xsm, stride_xsg,
                         BLOCK_SCALES: tl.constexpr, EVEN_K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP: tl.constexpr, FP8_MAX: tl.constexpr, EMULATE: tl.constexpr,
                         PREQUANT: tl.constexpr):
    pid_m, pid_k, pid_n, num_m, k_begin, k_end = program_tile(M, K, SPLIT_K, BLOCK_M, BLOCK_K)
    rn, rm, n_ok, m_ok, w_ptrs, x_ptrs, scale_row = tile_pointers(
        X, W, S, M, N, pid_m, pid_n, k_begin, stride_xm, stride_wn, stride_sn, BLOCK_M, BLOCK_N,
        GROUP, GROUP)
    rg = tl.arange(0, GROUP)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        for g in tl.static_range(BLOCK_K // GROUP):  # the step's 128-wide groups
            if EVEN_K:
                w = tl.load(w_ptrs + g * GROUP, mask=n_ok[:, None], other=0.0)
                x = tl.load(x_ptrs + g * GROUP, mask=m_ok[None, :], other=0.0)
            else:
                k_ok = k0 + g * GROUP + rg < K
                w = tl.load(w_ptrs + g * GROUP, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_ptrs + g * GROUP, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            if PREQUANT:  # x: e4m3 already, its scales per (token, group) in XS
                x_scale = tl.load(XS + rm * stride_xsm + (k0 // GROUP + g) * stride_xsg,
                                  mask=m_ok, other=0.0)
                if EMULATE:
                    part = tl.dot(w.to(tl.float32), x.to(tl.float32))
                else:
                    part = tl.dot(w, x)
            else:
                part, x_scale = _group_product(w, x, EMULATE, FP8_MAX)
            if BLOCK_SCALES:
                if BLOCK_N <= GROUP:  # the tile lies inside one scale block row
                    w_scale = tl.load(scale_row + k0 // GROUP + g)
                    acc += part * (x_scale * w_scale)[None, :]
                else:  # the tile spans block rows: a scale per weight row
                    row_scales = tl.load(S + (rn // GROUP) * stride_sn + k0 // GROUP + g,
                                         mask=n_ok, other=0.0)
                    acc += part * x_scale[None, :] * row_scales[:, None]
            else:
                acc += part * x_scale[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    finish_tile(acc, Y, S, P, C, rm, rn, n_ok, m_ok, pid_m, pid_k, pid_n, num_m, N, ws_rows,
                stride_ym, SPLIT_K, BLOCK_SCALES, BLOCK_N, BLOCK_M)


def launch(x2: torch.Tensor, weight: QuantizedWeight, y: torch.Tensor,
           cfg: DecodeConfig) -> torch.Tensor:
    """Run the kernel with ``cfg`` into ``y`` ``[rows, out]`` (``x2`` unit-strided along K);
    returns ``y``."""
    if cfg.block_k % BLOCK:
        raise ValueError(f"fp8 W8A8-dynamic decode GEMM: {cfg}: block_k must be a multiple of "
                         f"the {BLOCK}-wide activation groups")
    unused = shared.unused_pointers(x2.device)[0]
    return shared.launch(_w8a8_dynamic_kernel, x2, weight, y, cfg, extra=(unused, 0, 0),
                         FP8_MAX=E4M3_MAX, EMULATE=_INTERPRETED, PREQUANT=False)


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2`` per token and 128-wide group -> (e4m3 ``[rows, in]``, fp32 scales ``[rows,
    groups]``, any strides): the Triton quantization kernel on the GPU (``act_quant_kernel``),
    torch's (``quantize.quantize_activation``) in the interpreter."""
    if _INTERPRETED or not x2.is_cuda:
        return quantize_activation(x2.float(), "block")
    from parallel_models.inference.fp8.act_quant_kernel import quantize_token_groups

    return quantize_token_groups(x2)


def launch_prequantized(x2: torch.Tensor, weight: QuantizedWeight, y: torch.Tensor,
                        cfg: DecodeConfig) -> torch.Tensor:
    """The ``"w8a8"`` kernel: ``x2`` quantized first (:func:`quantize_rows`, one launch), then
    the same GEMM reading the e4m3 activations and their scales (no quantization work in the
    K loop); into ``y``; returns ``y``."""
    if cfg.block_k % BLOCK:
        raise ValueError(f"fp8 W8A8 decode GEMM: {cfg}: block_k must be a multiple of the "
                         f"{BLOCK}-wide activation groups")
    q, scales = quantize_rows(x2)
    return shared.launch(_w8a8_dynamic_kernel, q, weight, y, cfg,
                         extra=(scales, scales.stride(0), scales.stride(1)), FP8_MAX=E4M3_MAX,
                         EMULATE=_INTERPRETED, PREQUANT=True)


def dynamic_act_mm(x2: torch.Tensor, weight: QuantizedWeight,
                   config: DecodeConfig | None = None) -> torch.Tensor:
    """``x2`` ``[rows, in]`` (CUDA: bf16/fp16; the interpreter: fp32 too) quantized per token
    and 128-wide group, times ``dequantize(W)^T``, in ``x2``'s dtype; ``config``: these tiles
    (default: ``decode_tuning.choose`` among this kernel's candidates, timed on the first product
    of a new shape outside a graph capture)."""
    return shared.product(KERNEL, launch, x2, weight, config)


def prequantized_mm(x2: torch.Tensor, weight: QuantizedWeight,
                    config: DecodeConfig | None = None) -> torch.Tensor:
    """The same product as :func:`dynamic_act_mm` (the activations quantized per token and
    128-wide group first, by a kernel of their own), in ``x2``'s dtype; ``config`` as there,
    among the ``"w8a8"`` kernel's candidates."""
    return shared.product(KERNEL_PREQUANT, launch_prequantized, x2, weight, config)


__all__ = ["KERNEL", "KERNEL_PREQUANT", "dynamic_act_mm", "launch", "launch_prequantized",
           "prequantized_mm", "quantize_rows"]
