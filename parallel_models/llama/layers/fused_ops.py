"""Elementwise parts of the decoder (RMSNorm, residual add + RMSNorm, rotary, SwiGLU), fused on GPU.

Two variants a config can switch on (Gemma): RMSNorm scaling by ``(1 + w)`` in fp32 before the
cast back (``unit_offset=True``) and the gated GELU-tanh MLP (:func:`gated_activation`); these
always take the compiled (GPU) / eager path, never the hand-written Triton or exact kernels.

Each op is written once, in eager PyTorch, with the arithmetic transformers uses (the CPU path and
the reference). On CUDA the same function runs through ``torch.compile``, which turns each one
into one Triton kernel forward and one backward instead of 5-10 elementwise passes over the
activations (in eager mode those passes took ~40% of a training step: bench/train_bench.py
--profile). The option ``compile`` off (``PARALLEL_MODELS_COMPILE=0``) switches compilation off
(utils/gpu_compile.py).

With the option ``triton_elementwise`` on (``PARALLEL_MODELS_TRITON_ELEMENTWISE=1``) SwiGLU and
the two RMSNorms go to hand-written Triton kernels on CUDA instead (``elementwise_triton``: one
pass each way, where inductor's backwards read their inputs twice; opt-in, see there why). Exact
mode keeps its own kernels.

An FP8 rollout can install an output quantizer (:func:`set_output_quantizer`,
``inference/fp8/fused_producers``): the RMSNorms and SwiGLU it wants (decode-sized CUDA rows while
its TMA decode GEMM is on) run its kernels instead, which also leave an e4m3 copy of their output
for the FP8 linear after them. Exact mode and the Gemma variants never go there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel_models.llama.layers import elementwise_triton, exact
from parallel_models.llama.layers.rotary import apply_rotary
from parallel_models.utils.gpu_compile import compiled_on_gpu


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: the normalized input times ``(1 + w)``, both in fp32, then cast back."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.to(torch.float32))).to(x.dtype)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + residual, rms_norm(x + residual)): the pre-norm layer's residual add and next norm."""
    total = x + residual
    return total, _rms_norm(total, weight, eps)


def _add_rms_norm_unit_offset(x, residual, weight, eps):
    total = x + residual
    return total, _rms_norm_unit_offset(total, weight, eps)


def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q ``[tokens, heads, d]``, k ``[tokens, kv_heads, d]``, cos/sin ``[tokens, d]``."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``[..., 2 * inter]`` holding [gate; up] -> silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _geglu_tanh(gate_up: torch.Tensor) -> torch.Tensor:
    """``[..., 2 * inter]`` holding [gate; up] -> gelu_tanh(gate) * up (HF gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


_compiled_rms_norm = compiled_on_gpu(_rms_norm)
_compiled_add_rms_norm = compiled_on_gpu(_add_rms_norm)
_compiled_rms_norm_unit_offset = compiled_on_gpu(_rms_norm_unit_offset)
_compiled_add_rms_norm_unit_offset = compiled_on_gpu(_add_rms_norm_unit_offset)


_output_quantizer = None  # inference/fp8/fused_producers' OutputQuantizer, once imported


def set_output_quantizer(quantizer) -> None:
    """Install ``quantizer`` (``wanted(*tensors) -> bool``, ``rms_norm(x, residual, weight, eps)
    -> (total or None, y)``, ``swiglu(gate_up) -> y``, ``gated_mlp_input(gate_up_linear, x,
    hidden_act) -> y or None``) for the ops it wants; None removes it."""
    global _output_quantizer
    _output_quantizer = quantizer


def _quantizing(*tensors: torch.Tensor):
    """The installed output quantizer where it wants these operands, else None."""
    quantizer = _output_quantizer
    return quantizer if quantizer is not None and quantizer.wanted(*tensors) else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
             ) -> torch.Tensor:
    """RMSNorm over the last dim (the batch-invariant kernel in exact mode: layers/exact);
    ``unit_offset``: scale by ``(1 + w)`` in fp32 (Gemma)."""
    if unit_offset:
        return _compiled_rms_norm_unit_offset(x, weight, eps)
    if exact.enabled():
        from parallel_models.llama.layers.exact import ops

        return ops.rms_norm(x, weight, eps, reference=_rms_norm)
    quantizer = _quantizing(x, weight)
    if quantizer is not None:
        return quantizer.rms_norm(x, None, weight, eps)[1]
    if elementwise_triton.use_for(x, weight):
        return elementwise_triton.rms_norm(x, weight, eps)
    return _compiled_rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 unit_offset: bool = False):
    """(x + residual, rms_norm(x + residual))."""
    if unit_offset:
        return _compiled_add_rms_norm_unit_offset(x, residual, weight, eps)
    if exact.enabled():
        total = x + residual
        return total, rms_norm(total, weight, eps)
    quantizer = _quantizing(x, residual, weight)
    if quantizer is not None:
        return quantizer.rms_norm(x, residual, weight, eps)
    if elementwise_triton.use_for(x, residual, weight):
        return elementwise_triton.add_rms_norm(x, residual, weight, eps)
    return _compiled_add_rms_norm(x, residual, weight, eps)


rotary = compiled_on_gpu(_rotary)
_compiled_swiglu = compiled_on_gpu(_swiglu)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``[..., 2 * inter]`` holding [gate; up] -> silu(gate) * up (eager in exact mode)."""
    if exact.enabled():
        return _compiled_swiglu(gate_up)
    quantizer = _quantizing(gate_up)
    if quantizer is not None:
        return quantizer.swiglu(gate_up)
    if elementwise_triton.use_for(gate_up):
        return elementwise_triton.swiglu(gate_up)
    return _compiled_swiglu(gate_up)


_compiled_geglu_tanh = compiled_on_gpu(_geglu_tanh)


def gated_mlp_input(gate_up_linear: torch.nn.Module, x: torch.Tensor,
                    hidden_act: str) -> torch.Tensor:
    """``act(gate) * up`` of ``gate_up_linear(x)``: in one kernel where the installed output
    quantizer fuses the two (the FP8 rollout's decode steps), else the linear, then
    :func:`gated_activation`."""
    quantizer = _output_quantizer
    if quantizer is not None and not exact.enabled():
        fused = quantizer.gated_mlp_input(gate_up_linear, x, hidden_act)
        if fused is not None:
            return fused
    gate_up, _ = gate_up_linear(x)
    return gated_activation(gate_up, hidden_act)


def gated_activation(gate_up: torch.Tensor, hidden_act: str) -> torch.Tensor:
    """The gated MLP's ``act(gate) * up`` for ModelConfig.hidden_act (silu: :func:`swiglu`)."""
    if hidden_act == "silu":
        return swiglu(gate_up)
    if hidden_act == "gelu_pytorch_tanh":
        return _compiled_geglu_tanh(gate_up)
    raise ValueError(f"hidden_act {hidden_act!r} has no gated MLP here")
