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
A forward with autograd stacks the local experts' weights (one copy per projection, freed after
the backward); one without reads them in place, packed once into a tensor per projection that
the expert parameters are views of (``GroupedGemmExperts.stacked_weights``). Used when
``use_grouped_gemm()`` says so: by default on CUDA devices of compute capability 9.0+ (Hopper)
with bf16 activations; the option ``moe_grouped_gemm`` (``parallel_models.options``; env
``PARALLEL_MODELS_MOE_GROUPED_GEMM``) true forces it (e.g. to test it on the CPU), false turns
it off; ``moe_packed_experts`` false stacks the weights in every forward instead of packing.
While an FP8 rollout is on (``inference/fp8``: ``fp8_state.active``) its ``experts_forward``
runs instead (FP8 grouped GEMMs on packed FP8 copies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from parallel_models.llama.layers import exact
from parallel_models.options import option



def use_grouped_gemm(hidden: torch.Tensor) -> bool:
    """Whether to run the experts as grouped GEMMs for activations ``hidden``."""
    if exact.enabled():  # exact mode's grouped kernel (layers/exact) takes any device and dtype
        return True
    setting = option("moe_grouped_gemm")  # "auto" | True | False
    if setting != "auto" or not hasattr(torch, "_grouped_mm"):
        return setting is True and hasattr(torch, "_grouped_mm")
    return (hidden.is_cuda and hidden.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(hidden.device) >= (9, 0))


def packed_view(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """``weights`` as one ``[n, *shape]`` view without a copy when they are consecutive equal
    contiguous slices of one storage (else None)."""
    first = weights[0]
    if not first.is_contiguous():
        return None
    base, size = first.untyped_storage().data_ptr(), first.numel()
    offset = first.storage_offset()
    for i, w in enumerate(weights):
        if (w.shape != first.shape or w.dtype != first.dtype or not w.is_contiguous()
                or w.untyped_storage().data_ptr() != base
                or w.storage_offset() != offset + i * size):
            return None
    return first.detach().as_strided((len(weights), *first.shape), (size, *first.stride()),
                                     offset)


def _may_pack(weights: list[torch.Tensor]) -> bool:
    """Whether the weights may be re-pointed into one new tensor: each owns its storage (not a
    view into a buffer someone else manages, e.g. megatron DDP's parameter buffer), and no CUDA
    graph is being captured (the packed tensor must not live in a graph's private pool)."""
    if weights[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return all(w.storage_offset() == 0 and
               w.untyped_storage().nbytes() == w.numel() * w.element_size() for w in weights)


def _pack(weights: list[torch.Tensor]) -> torch.Tensor:
    """Copy ``weights`` (parameters) into one ``[n, *shape]`` tensor and make each parameter a
    view of its slice (same values; optimizers, hooks and in-place loads keep working)."""
    packed = torch.stack([w.detach() for w in weights])
    for i, w in enumerate(weights):
        w.data = packed[i]
    return packed


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

    def stacked_weights(self, attr: str) -> torch.Tensor:
        """The local experts' ``attr`` (``linear_fc1`` / ``linear_fc2``) weights as one
        ``[experts, out, in]`` tensor. With autograd: a stack (its backward hands each expert
        its gradient). Without: the weights themselves, packed once into one tensor they are
        views of (:func:`packed_view`), so a decode step reads them in place instead of copying
        every expert's weights first (3x the weight traffic of an MoE decode step)."""
        weights = [getattr(e, attr).weight for e in self.local_experts]
        if (torch.is_grad_enabled() and weights[0].requires_grad) or \
                not option("moe_packed_experts"):
            return torch.stack(weights)
        packed = packed_view(weights)
        if packed is None and _may_pack(weights):
            packed = _pack(weights)
        return packed if packed is not None else torch.stack(weights)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        fp8 = getattr(self, "fp8_state", None)  # an FP8 rollout (inference/fp8)
        lora = getattr(self, "lora", None)  # per-expert LoRA (parallel_models/lora/experts.py)
        if fp8 is not None and fp8.active:
            if lora is not None and lora.enabled:
                raise ValueError("an FP8 rollout of MoE experts with LoRA adapters: merge them")
            return fp8.experts_forward(self, x, tokens_per_expert, permuted_probs)
        if (self.num_local_experts == 1 or self.config.moe_apply_probs_on_input
                or self.config.fp8 or self.config.fp4 or not use_grouped_gemm(x)):
            return super().forward(x, tokens_per_expert, permuted_probs)
        counts = torch.as_tensor(tokens_per_expert).to(device=x.device)
        offs = torch.cumsum(counts, dim=0).to(torch.int32)
        w1 = self.stacked_weights("linear_fc1").transpose(1, 2)
        w2 = self.stacked_weights("linear_fc2").transpose(1, 2)
        fc1 = torch._grouped_mm(x, w1, offs=offs)
        if lora is not None and lora.active("gate_up_proj"):
            fc1 = fc1 + lora.grouped_delta("gate_up_proj", x, offs).to(fc1.dtype)
        fc1 = _ContiguousGrad.apply(fc1)
        gate, up = torch.chunk(fc1, 2, dim=-1)
        act = F.silu(gate) * up
        act = (act * permuted_probs.unsqueeze(-1)).to(x.dtype)
        out = torch._grouped_mm(act, w2, offs=offs)
        if lora is not None and lora.active("down_proj"):
            out = out + lora.grouped_delta("down_proj", act, offs).to(out.dtype)
        return _ContiguousGrad.apply(out), None
