"""FP8 (e4m3) quantization of linear weights and activations, as the FP8 rollout stores them.

Weights (``[out, in]``), two granularities:

- ``"block"``: one fp32 scale per 128 x 128 block (DeepSeek-V3's recipe, also verl's / slime's):
  ``scale = amax(block) / 448`` (448: e4m3's largest finite value), ``q = round(w / scale)`` in
  e4m3. The scales are ``[ceil(out/128), ceil(in/128)]``; edge blocks of a shape that is not a
  multiple of 128 are the partial blocks (their amax is taken over the real values only: the
  padding is zeros).
- ``"channel"``: one scale per output row (``[out]``), the layout ``torch._scaled_mm``'s row-wise
  mode takes on any FP8 GPU (SM 8.9+).

Activations (``[tokens, in]``) follow the weight's granularity: per token and 128-wide group of
the input features (``[tokens, ceil(in/128)]`` scales, the 1 x 128 tiles that pair with 128 x 128
weight blocks), or per token (``[tokens]``) for ``"channel"``.

A block whose amax is 0 gets scale 1 (all its values quantize to 0 exactly). Rounding is
round-to-nearest-even by the ``.to(torch.float8_e4m3fn)`` cast, so a normal value's error is at
most 2^-4 of its magnitude and a subnormal's at most 2^-10 * scale (half the step 2^-9).

Weights are divided by their scale; activations are multiplied by the correctly rounded
reciprocal of theirs (``x * (1 / scale)``), which is what the decode kernels compute in registers
(a multiply per element instead of a division) and the activation-quantization kernel too, so
every path rounds the same activations to the same e4m3 values. The two differ: bf16 activations
over a bf16 amax often land exactly on an e4m3 tie (x / scale = 200.0 between 192 and 208, ~5 in
10^4 elements of random bf16 activations), which the division rounds to even and the
reciprocal's product (200.00002) rounds up.
"""

from __future__ import annotations

import dataclasses

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
BLOCK = 128
GRANULARITIES = ("block", "channel")
QUANTIZED_COPY = "fp8_token_quantized"
"""The attribute under which a kernel that produced an activation leaves its e4m3 copy
``(e4m3 [rows, in], fp32 scales)`` for the FP8 linear that reads it (``fused_producers``,
``tma_decode_kernel.quantized_input``): scales per token ``[rows]``, or per token and group
of inputs ``[rows, in / group]`` (groups of 64 or 128: ``swiglu_gemm_kernel``)."""
MAX_PRODUCER_COLS = 32768
"""The widest row the fused producer kernels hold in one program (``producer_kernels``)."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"fp8 granularity must be one of {GRANULARITIES}, got {granularity!r}")


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scale of blocks with absolute maximum ``amax`` (1 for an all-zero block)."""
    amax = amax.float()
    # a tensor divisor: CUDA divides a tensor by a Python scalar as a multiply by the scalar's
    # (rounded) reciprocal, which differs from the division in the last bit for some amax; the
    # Triton kernels and the CPU divide (measured on an H100: 0.16 % of activations quantized
    # one e4m3 step apart before)
    return torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))


def _to_e4m3(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (values.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _activation_to_e4m3(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Activations: times the reciprocal of the scale (the kernels' recipe: module docstring)."""
    return (values.float() * torch.reciprocal(scale)).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` (2-D) zero-padded at the end to ``rows`` x ``cols`` (itself when it fits)."""
    if t.shape == (rows, cols):
        return t
    return torch.nn.functional.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]))


@dataclasses.dataclass
class QuantizedWeight:
    """An FP8 weight: ``data`` ``[out, in]`` e4m3 and its fp32 ``scale`` (block:
    ``[ceil(out/128), ceil(in/128)]``; channel: ``[out]``)."""

    data: torch.Tensor
    scale: torch.Tensor
    granularity: str

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight(self.data, self.scale, self.granularity, dtype)


def fp8_weight_of(module: torch.nn.Module) -> QuantizedWeight:
    """The FP8 copy ``rollout_linears.Fp8Linears`` keeps on a linear: its ``fp8_weight`` /
    ``fp8_scale`` buffers and ``fp8_granularity``."""
    return QuantizedWeight(module.fp8_weight, module.fp8_scale, module.fp8_granularity)


def reshape_keeping_copy(x: torch.Tensor, *shape) -> torch.Tensor:
    """``x.reshape(*shape)`` with the e4m3 copy its producer left on ``x`` (:data:`QUANTIZED_COPY`,
    if any) left on the result too (a reshape is a new tensor object)."""
    y = x.reshape(*shape)
    copy = getattr(x, QUANTIZED_COPY, None)
    if copy is not None and y is not x:
        setattr(y, QUANTIZED_COPY, copy)
    return y


def weight_scale_shape(shape, granularity: str) -> tuple[int, ...]:
    """Shape of the scales of a ``[out, in]`` weight."""
    _check_granularity(granularity)
    out, inp = shape
    return (_ceil_div(out, BLOCK), _ceil_div(inp, BLOCK)) if granularity == "block" else (out,)


@torch.no_grad()
def quantize_weight(w: torch.Tensor, granularity: str = "block",
                    out: QuantizedWeight | None = None) -> QuantizedWeight:
    """Quantize a 2-D weight ``[out, in]``; ``out``: write into its tensors in place (their
    addresses stay: CUDA graphs captured on them see the new values)."""
    _check_granularity(granularity)
    if w.dim() != 2:
        raise ValueError(f"quantize_weight takes a 2-D weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    if granularity == "channel":
        scale = _scale_of(w.abs().amax(dim=1))
        data = _to_e4m3(w, scale[:, None])
    else:
        nb, kb = _ceil_div(rows, BLOCK), _ceil_div(cols, BLOCK)
        padded = _pad_to(w, nb * BLOCK, kb * BLOCK).view(nb, BLOCK, kb, BLOCK)
        scale = _scale_of(padded.abs().amax(dim=(1, 3)))
        data = _to_e4m3(padded, scale[:, None, :, None]).view(nb * BLOCK, kb * BLOCK)
        data = data[:rows, :cols]
    if out is None:
        return QuantizedWeight(data.contiguous(), scale, granularity)
    out.data.copy_(data)
    out.scale.copy_(scale)
    return out


def dequantize_weight(data: torch.Tensor, scale: torch.Tensor, granularity: str,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight an FP8 ``data`` with ``scale`` stands for, in ``dtype``."""
    _check_granularity(granularity)
    if granularity == "channel":
        return (data.float() * scale[:, None]).to(dtype)
    rows, cols = data.shape
    full = scale.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    return (data.float() * full[:rows, :cols]).to(dtype)


@torch.no_grad()
def quantize_activation(x: torch.Tensor, granularity: str = "block", group: int = BLOCK
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[tokens, in]`` -> (e4m3 ``[tokens, in]``, fp32 scales): per token and ``group``-wide
    group of inputs (``[tokens, ceil(in/group)]``, "block") or per token (``[tokens]``,
    "channel")."""
    _check_granularity(granularity)
    tokens, cols = x.shape
    if granularity == "channel":
        scale = _scale_of(x.abs().amax(dim=1))
        return _activation_to_e4m3(x, scale[:, None]), scale
    kb = _ceil_div(cols, group)
    grouped = _pad_to(x, tokens, kb * group).view(tokens, kb, group)
    scale = _scale_of(grouped.abs().amax(dim=2))
    data = _activation_to_e4m3(grouped, scale[:, :, None]).view(tokens, kb * group)[:, :cols]
    return data, scale


def dequantize_activation(data: torch.Tensor, scale: torch.Tensor, granularity: str,
                          dtype: torch.dtype = torch.float32, group: int = BLOCK) -> torch.Tensor:
    """The activations an FP8 ``data`` with ``scale`` (from :func:`quantize_activation`) stand
    for, in ``dtype``."""
    _check_granularity(granularity)
    if granularity == "channel":
        return (data.float() * scale[:, None]).to(dtype)
    full = scale.repeat_interleave(group, dim=1)[:, : data.shape[1]]
    return (data.float() * full).to(dtype)


__all__ = ["BLOCK", "E4M3", "E4M3_MAX", "GRANULARITIES", "MAX_PRODUCER_COLS", "QUANTIZED_COPY",
           "QuantizedWeight", "dequantize_activation", "dequantize_weight", "quantize_activation",
           "fp8_weight_of", "reshape_keeping_copy",
           "quantize_weight", "weight_scale_shape"]
