"""FP8 activations written by the kernels that produce them. While an FP8 rollout decodes
through the TMA decode GEMM (``gemm.DECODE_KERNEL == "tma"``), the decoder's RMSNorms
(with the residual add before them) and its SwiGLU each also write their output quantized per
token to e4m3 (``producer_kernels``). The copy is left on the output tensor, under the attribute
``quantize.QUANTIZED_COPY``. The FP8 linear that reads that output next (qkv / gate_up after a
norm, down after SwiGLU) takes the copy as it is (``tma_decode_kernel.quantized_input``), so it
needs no quantization launch of its own. At 64 rows that launch cost 6-11 us on an H100, and a
Llama-3-8B decode step had 96 of them.

The hook: ``llama/layers/fused_ops`` asks the quantizer installed with
``fused_ops.set_output_quantizer`` (this module's :data:`QUANTIZER`, installed when the module is
imported) whether it wants a given op. It says yes only under all of these conditions:

- an :class:`~parallel_models.inference.fp8.rollout_linears.Fp8Linears` with channel scales is
  generating (inside its ``enabled()``: :func:`tracking`);
- the TMA kernel is the decode kernel;
- the rows are decode-sized (at most ``gemm.DECODE_ROWS``);
- the tensors are CUDA bf16/fp16, contiguous, without gradients;
- a row fits one program (``quantize.MAX_PRODUCER_COLS``).

Otherwise the op runs as before. The dense MLP's gate_up GEMM and its SwiGLU go further: one
kernel (``swiglu_gemm_kernel``) computes both and leaves the output's e4m3 copy with a scale per
token and 64 or 128 features, which the down GEMM multiplies group by group
(:meth:`OutputQuantizer.gated_mlp_input`, asked by ``fused_ops.gated_mlp_input``). The output
in the model's dtype is the eager reference's rounding (see ``producer_kernels``). A copy that
no FP8 linear reads (the final norm's, before the LM head) costs one small write.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from parallel_models.inference.fp8 import gemm
from parallel_models.inference.fp8.quantize import (MAX_PRODUCER_COLS, QUANTIZED_COPY,
                                                    fp8_weight_of, reshape_keeping_copy)
from parallel_models.llama.layers import fused_ops

_active = weakref.WeakSet()  # the channel-scaled Fp8Linears generating (Fp8Linears.enabled)
FUSE_GATE_UP = True
"""Run the dense MLP's gate_up GEMM and SwiGLU as one kernel at decode
(:meth:`OutputQuantizer.gated_mlp_input`; False: the GEMM, then the SwiGLU producer)."""
DTYPES = (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def tracking(state):
    """Inside: ``state`` (an Fp8Linears, channel scales) generates with its FP8 forward on
    (``Fp8Linears.enabled``); nested calls keep it on until the outermost ends."""
    tracked = state in _active
    if state.granularity == "channel":
        _active.add(state)
    try:
        yield
    finally:
        if not tracked:
            _active.discard(state)


class OutputQuantizer:
    """What ``fused_ops`` calls (see the module docstring)."""

    def wanted(self, *tensors: torch.Tensor) -> bool:
        x = tensors[0]
        if not _active or gemm.DECODE_KERNEL != "tma" or not x.is_cuda:
            return False
        cols = x.shape[-1]
        rows = x.numel() // max(cols, 1)
        return (0 < rows <= gemm.DECODE_ROWS and cols <= MAX_PRODUCER_COLS and cols % 16 == 0
                and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and all(t.dtype in DTYPES and t.is_contiguous() for t in tensors))

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float):
        """-> (``x + residual`` or None, rms_norm of it with its e4m3 copy left on it)."""
        from parallel_models.inference.fp8.producer_kernels import rms_norm_quantized

        n = x.shape[-1]
        total, y, copy = rms_norm_quantized(x.reshape(-1, n), None if residual is None
                                            else residual.reshape(-1, n), weight, eps)
        y = y.view(x.shape)
        setattr(y, QUANTIZED_COPY, copy)
        return (total.view(x.shape) if total is not None else None), y

    def gated_mlp_input(self, linear: torch.nn.Module, x: torch.Tensor,
                        hidden_act: str) -> torch.Tensor | None:
        """``silu(gate) * up`` of the FP8 ``[gate; up]`` ``linear`` on ``x`` from the fused
        kernel (``swiglu_gemm_kernel``; its group-scaled e4m3 copy left on it), or None where
        that does not apply (:data:`FUSE_GATE_UP` off, another activation, a bias, the linear
        not generating in FP8, the conditions of :meth:`wanted`, a shape it does not take)."""
        state = getattr(linear, "fp8_state", None)
        if not FUSE_GATE_UP or hidden_act != "silu" or state not in _active or \
                linear.bias is not None or getattr(linear, "gather_output", False) or \
                not self.wanted(x):
            return None
        from parallel_models.inference.fp8 import swiglu_gemm_kernel

        weight = fp8_weight_of(linear)
        x2 = reshape_keeping_copy(x, -1, x.shape[-1])  # (the norm's copy: the kernel's input)
        if not swiglu_gemm_kernel.supports(x2, weight) or \
                gemm.decode_kernel(x.device, weight.granularity) != "tma":
            return None
        h = swiglu_gemm_kernel.gate_up_swiglu(x2, weight)
        return reshape_keeping_copy(h, *x.shape[:-1], h.shape[-1])

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` with its e4m3 copy left on it."""
        from parallel_models.inference.fp8.producer_kernels import swiglu_quantized

        y, copy = swiglu_quantized(gate_up.reshape(-1, gate_up.shape[-1]))
        y = y.view(*gate_up.shape[:-1], y.shape[-1])
        setattr(y, QUANTIZED_COPY, copy)
        return y


QUANTIZER = OutputQuantizer()
fused_ops.set_output_quantizer(QUANTIZER)

__all__ = ["QUANTIZER", "OutputQuantizer", "tracking"]
