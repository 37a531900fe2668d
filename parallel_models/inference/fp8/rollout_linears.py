"""FP8 weights for a rollout model's linears: :class:`Fp8Linears` gives every projection of the
decoder layers (attention qkv / o, MLP gate_up / down, the MoE experts' fc1 / fc2 and shared
experts) an FP8 copy of its weight and a forward that runs the FP8 GEMM on it
(:func:`~parallel_models.inference.fp8.gemm.fp8_linear`). The LM head, the embeddings, the norms
and the router stay in the model's dtype. The experts of a grouped-GEMM layer take per-channel
scales and packed buffers, and run as FP8 grouped GEMMs (:mod:`.grouped_experts`).

The module keeps its parameter (the weight sync, the server's push and folder load, the actor's
training all write and read it as before, names and shapes unchanged); the FP8 copy lives in two
non-persistent buffers of the module (``fp8_weight``, ``fp8_scale``), refreshed in place by
:meth:`Fp8Linears.refresh` after the parameter changed, so a CUDA graph captured on them reads
the new values. While :attr:`Fp8Linears.active` is False the modules run their own forward (the
in-process engine on the actor's weights turns FP8 on for its generates only: the actor trains and
scores on the bf16 weights). The forward mirrors megatron-core's Column/RowParallelLinear for
the rollout model (no sequence parallel, outputs not gathered): the row-parallel output is
all-reduced over the module's TP group; a bias is added after.

Memory: the FP8 copy adds 1 byte (+ scales) per linear weight element next to the parameter;
what a decode step reads from the linears is halved.
"""

from __future__ import annotations

import contextlib
import types

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)

from parallel_models.inference.fp8 import fused_producers
from parallel_models.inference.fp8.gemm import block_scale_storage, fp8_linear, gemm_backend
from parallel_models.inference.fp8.grouped_experts import (EXPERT_GRANULARITY, expert_linears,
                                                           fp8_experts_forward, pack_experts)
from parallel_models.inference.fp8.quantize import E4M3, fp8_weight_of, quantize_weight

# the decoder layers' projections (dense: layers/attention.py, layers/mlp.py; MoE experts and
# shared experts: megatron-core's MLP names)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "linear_fc1", "linear_fc2")


def quantized_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of the linears :class:`Fp8Linears` quantizes."""
    return [(name, m) for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] in PROJECTIONS
            and isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


class Fp8Linears:
    """``Fp8Linears(model, granularity="channel", active=True)``: quantize ``model``'s linears (see
    the module docstring) now; :meth:`refresh` after their weights changed; :meth:`enabled` (a
    context) runs the FP8 forward inside it whatever :attr:`active` says."""

    def __init__(self, model: torch.nn.Module, granularity: str = "channel", active: bool = True):
        self.model = model
        self.granularity = granularity
        self.active = active
        self.modules = quantized_modules(model)
        if not self.modules:
            raise ValueError(f"{type(model).__name__} has no linears to quantize to fp8")
        # grouped-GEMM experts: channel scales, packed per projection (fp8/grouped_experts.py)
        self.grouped = [m for m in model.modules() if hasattr(m, "stacked_weights")]
        in_groups = {id(lin) for g in self.grouped for mods in expert_linears(g).values()
                     for lin in mods}
        for name, module in self.modules:
            module.fp8_granularity = EXPERT_GRANULARITY if id(module) in in_groups else \
                granularity
            self._attach(name, module)
        for g in self.grouped:
            g.fp8_state = self
            pack_experts(g)
        self.in_groups = in_groups
        self.refresh()

    # ---- setup ---------------------------------------------------------------------------------
    def _attach(self, name: str, module: torch.nn.Module) -> None:
        if getattr(module, "sequence_parallel", False):
            raise ValueError(f"fp8 rollout: {name} is sequence-parallel; the rollout model is "
                             "built without sequence parallel")
        module.fp8_state = self
        self._allocate(module)
        module.forward = types.MethodType(_fp8_forward, module)

    def _allocate(self, module: torch.nn.Module) -> None:
        """(Re)make the module's FP8 buffers on its weight's device."""
        weight = module.weight
        out, inp = weight.shape
        module.register_buffer("fp8_weight", torch.empty(out, inp, dtype=E4M3,
                                                          device=weight.device), persistent=False)
        scale = (block_scale_storage(out, inp, weight.device)
                 if module.fp8_granularity == "block"
                 else torch.ones(out, dtype=torch.float32, device=weight.device))
        module.register_buffer("fp8_scale", scale, persistent=False)
        module.fp8_backend = None

    # ---- use -------------------------------------------------------------------------------------
    @torch.no_grad()
    def refresh(self) -> None:
        """Re-quantize every linear from its (new) weight, in place, on the weight's device."""
        for g in self.grouped:
            pack_experts(g)  # (a no-op unless the buffers were moved)
        for _, module in self.modules:
            if id(module) not in self.in_groups and (
                    module.fp8_weight.device != module.weight.device
                    or (module.fp8_granularity == "block" and module.fp8_scale.stride(0) % 4)):
                self._allocate(module)  # moved (offloaded and back): the kernel's layout again
            quantize_weight(module.weight.detach(), module.fp8_granularity,
                            out=fp8_weight_of(module))
        self.stale = False

    def experts_forward(self, experts, x, tokens_per_expert, permuted_probs):
        """A ``GroupedGemmExperts`` layer's forward while FP8 is on: two FP8 grouped GEMMs
        when it would run grouped GEMMs, else its experts' FP8 linears one by one."""
        from megatron.core.transformer.moe.experts import SequentialMLP

        from parallel_models.llama.layers.grouped_experts import use_grouped_gemm

        if experts.num_local_experts == 1 or experts.config.moe_apply_probs_on_input or \
                not use_grouped_gemm(x):
            return SequentialMLP.forward(experts, x, tokens_per_expert, permuted_probs)
        return fp8_experts_forward(experts, x, tokens_per_expert, permuted_probs)

    def mark_stale(self) -> None:
        """The weights changed: :meth:`refresh_if_stale` re-quantizes."""
        self.stale = True

    def refresh_if_stale(self) -> None:
        if self.stale:
            self.refresh()

    @contextlib.contextmanager
    def enabled(self):
        """Run the FP8 forward inside (refreshed first if stale), the decoder's norms and SwiGLU
        writing e4m3 copies of their outputs for it where it decodes through the TMA kernel
        (``fused_producers``: only inside, so another model's steps in the process keep their
        own kernels)."""
        self.refresh_if_stale()
        before, self.active = self.active, True
        with fused_producers.tracking(self):
            try:
                yield self
            finally:
                self.active = before

    @property
    def weight_bytes(self) -> int:
        """Bytes of the FP8 copies (weights + scales)."""
        return sum(m.fp8_weight.numel() + 4 * m.fp8_scale.numel() for _, m in self.modules)


def _fp8_forward(self, input_, *args, **kwargs):
    """Column/RowParallelLinear's forward on the FP8 copy (megatron's own while inactive or when
    called with its extra arguments)."""
    if not self.fp8_state.active or args or kwargs or torch.is_grad_enabled() and \
            self.weight.requires_grad:
        return type(self).forward(self, input_, *args, **kwargs)
    weight = fp8_weight_of(self)
    if self.fp8_backend is None:
        self.fp8_backend = gemm_backend(input_, weight)
    bias = self.bias if not self.skip_bias_add else None
    row = isinstance(self, RowParallelLinear)
    out = fp8_linear(input_, weight, None if row else bias, backend=self.fp8_backend)
    if row:
        if not self.explicit_expert_comm:
            out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if bias is not None:
            out = out + bias
    elif self.gather_output:
        out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
    return out, (self.bias if self.skip_bias_add else None)


__all__ = ["Fp8Linears", "PROJECTIONS", "quantized_modules"]
