"""Routed experts as one grouped GEMM per projection (``torch._grouped_mm``) instead of
megatron-core's loop over experts (``SequentialMLP``), with the same parameters.

megatron-core 0.16's grouped experts need transformer-engine (``TEGroupedMLP``) or the
``grouped_gemm`` package (legacy ``GroupedMLP``); PyTorch has its own grouped GEMM
(``torch._grouped_mm``: CUTLASS on Hopper, a reference kernel on the CPU). This subclass of
``SequentialMLP`` keeps the per-expert parameters (``local_experts.{e}.linear_fc1/fc2``: the
checkpoint layout, megatron-core's sharded state dict and our weight map are unchanged) and
computes, for the tokens the dispatcher sorted by expert:

    fc1 = grouped_mm(x, [W1_e^T]) -> silu(gate) * up, scaled by the routing probability
    out = grouped_mm(fc1, [W2_e^T])

exactly as megatron's expert MLP does (probabilities applied after the activation, in fp32).
Each forward stacks the local experts' weights (one copy per projection, freed after the
backward). Used when ``use_grouped_gemm()`` says so: by default on CUDA devices of compute
capability 9.0+ (Hopper) with bf16 activations; ``PARALLEL_MODELS_MOE_GROUPED_GEMM=1`` forces it
(e.g. to test it on the CPU), ``=0`` turns it off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from parallel_models.llama.layers import exact

ENV = "PARALLEL_MODELS_MOE_GROUPED_GEMM"


def use_grouped_gemm(hidden: torch.Tensor) -> bool:
    """Whether to run the experts as grouped GEMMs for activations ``hidden``."""
    if exact.enabled():  # exact mode's grouped kernel (layers/exact) takes any device and dtype
        return True
    setting = os.environ.get(ENV, "auto")
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"{ENV}={setting!r}: use 1 (on), 0 (off) or leave it unset (auto)")
    if setting != "auto" or not hasattr(torch, "_grouped_mm"):
        return setting == "1" and hasattr(torch, "_grouped_mm")
    return (hidden.is_cuda and hidden.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(hidden.device) >= (9, 0))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (the grouped GEMM's
    backward rejects expanded gradients, e.g. the one of ``out.sum()``)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class GroupedGemmExperts(SequentialMLP):
    """``SequentialMLP`` whose forward is two grouped GEMMs (see the module doc)."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        if (self.num_local_experts == 1 or self.config.moe_apply_probs_on_input
                or self.config.fp8 or self.config.fp4 or not use_grouped_gemm(x)):
            return super().forward(x, tokens_per_expert, permuted_probs)
        counts = torch.as_tensor(tokens_per_expert).to(device=x.device)
        offs = torch.cumsum(counts, dim=0).to(torch.int32)
        w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts]).transpose(1, 2)
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts]).transpose(1, 2)
        fc1 = _ContiguousGrad.apply(torch._grouped_mm(x, w1, offs=offs))
        gate, up = torch.chunk(fc1, 2, dim=-1)
        act = F.silu(gate) * up
        act = (act * permuted_probs.unsqueeze(-1)).to(x.dtype)
        out = _ContiguousGrad.apply(torch._grouped_mm(act, w2, offs=offs))
        return out, None
