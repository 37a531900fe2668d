"""The MoE MLP of Qwen3-MoE, Qwen2-MoE and Mixtral: megatron-core's ``MoELayer`` (``TopKRouter``,
dropless all-to-all token dispatch over the expert-parallel group, ``SequentialMLP`` experts of
the local spec, run as grouped GEMMs on Hopper by ``grouped_experts.GroupedGemmExperts``,
``SharedExpertMLP`` with its sigmoid gate). Forwards without autograd and without expert or
tensor parallelism dispatch on the device (``moe_local_dispatch``: same values, capturable).

Routing matches transformers per family with megatron-core's own router options, no subclass of
its routing rule:
- ``norm_topk_prob`` (Qwen3-MoE, Mixtral, Qwen2-MoE when set): HF takes softmax over all experts,
  top-k, then divides by the top-k sum; that equals megatron's ``moe_router_pre_softmax=False``
  (top-k of the logits, softmax over those k);
- without it (Qwen2-MoE's default): softmax, top-k, no renormalization = ``pre_softmax=True``.
The router logits are computed in fp32 (``moe_router_dtype='fp32'``).

Parameter names are megatron-core's: ``router.weight``, ``experts.local_experts.{e}.linear_fc1``
(``[gate; up]``) / ``linear_fc2``, ``shared_experts.linear_fc1`` / ``linear_fc2`` /
``gate_weight``. Expert ``e`` here is global expert ``ep_rank * num_local_experts + e``.

The router can record its logits (``recording``) for the load-balancing loss
(``parallel_models.llama.layers.moe_aux_loss``), and carries a route hook for router replay
(``parallel_models.llama.layers.router_replay``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter

from parallel_models import megatron_fixes
from parallel_models.config import ConfigError, ModelConfig
from parallel_models.distributed import layout_or_training
from parallel_models.llama.layers import exact, moe_local_dispatch, router_replay
from parallel_models.llama.layers.grouped_experts import GroupedGemmExperts

megatron_fixes.apply()  # te_general_gemm undefined without transformer-engine


def moe_megatron_settings(config: ModelConfig) -> dict:
    """The ``TransformerConfig`` fields of an MoE model (empty for a dense one)."""
    if not config.is_moe:
        return {}
    if config.moe_top_k == 1 and config.norm_topk_prob:
        raise ConfigError(f"{config.architecture}: num_experts_per_tok=1 with norm_topk_prob=True "
                          "(every routing weight 1.0) is not supported: megatron-core's router "
                          "refuses top-1 softmax routing without pre-softmax")
    return dict(
        num_moe_experts=config.num_experts,
        moe_router_topk=config.moe_top_k,
        moe_ffn_hidden_size=config.moe_intermediate_size,
        moe_router_pre_softmax=not config.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",  # the HF-exact loss is ours (moe_aux_loss.py)
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_shared_expert_intermediate_size=config.shared_expert_intermediate_size or None,
        moe_shared_expert_gate=bool(config.shared_expert_gate),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
    )


class RecordingTopKRouter(TopKRouter):
    """megatron-core's ``TopKRouter`` that can keep the router logits of each forward (a list
    set by the model while the load-balancing loss is asked for; None otherwise)."""

    recording: list | None = None

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        logits = _exact_gating(self, input) if exact.enabled() else super().gating(input)
        if self.recording is not None:
            self.recording.append(logits.view(-1, logits.shape[-1]))
        return logits


def _exact_gating(router: TopKRouter, input: torch.Tensor) -> torch.Tensor:
    """The router logits as megatron-core's ``gating`` computes them, as a plain ``torch.mm``
    that exact mode routes to its batch-invariant matmul (megatron's own path may call
    transformer-engine's GEMM, which exact mode cannot see)."""
    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(router.config.moe_router_dtype,
                                                                 input.dtype)
    flat = input.reshape(-1, input.shape[-1]).to(dtype)
    if router.weight.device != input.device:  # megatron-core's gating moves it lazily too
        router.weight.data = router.weight.data.to(input.device)
    logits = torch.mm(flat, router.weight.to(dtype).t())
    if router.bias is not None:
        logits = logits + router.bias.to(device=input.device, dtype=dtype)
    return logits.view(*input.shape[:-1], -1)


class ParallelMoE(MoELayer):
    """megatron-core's MoE layer on ``[tokens, 1, hidden]``; returns the output only."""

    def __init__(self, config: ModelConfig, mp_config: TransformerConfig, layer_id: int,
                 layout=None):
        if not config.is_moe_layer(layer_id):
            raise ValueError(f"layer {layer_id} is not an MoE layer of {config.architecture} "
                             f"(moe_layer_ids: {list(config.moe_layer_ids)})")
        if not mp_config.num_moe_experts:
            raise ValueError("ParallelMoE needs a TransformerConfig built with the MoE fields "
                             "(moe_megatron_settings)")
        spec = get_moe_module_spec(use_te=False, num_experts=config.num_experts,
                                   moe_grouped_gemm=False)
        # megatron-core 0.16 returns a ModuleSpec of ModuleSpecs, 0.19 partials (builders)
        submodules = (spec.submodules if hasattr(spec, "submodules")
                      else spec.keywords["submodules"])
        submodules.router = RecordingTopKRouter
        experts = submodules.experts  # SequentialMLP -> it plus a grouped-GEMM path
        if isinstance(experts, functools.partial):
            submodules.experts = functools.partial(GroupedGemmExperts, *experts.args,
                                                   **experts.keywords)
        else:
            experts.module = GroupedGemmExperts
        layout = layout_or_training(layout)
        super().__init__(mp_config, submodules, layer_number=layer_id + 1,
                         pg_collection=layout.moe_groups())
        self.parallel_layout = layout
        router_replay.attach(self.router, list(config.moe_layer_ids).index(layer_id),
                             mp_config.sequence_parallel, layout)
        _mark_expert_parallel(self)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if moe_local_dispatch.applies(self, hidden):  # no host copies: CUDA-graph capturable
            return moe_local_dispatch.forward(self, hidden)
        out, bias = super().forward(hidden)
        return out if bias is None else out + bias


def _mark_expert_parallel(moe: MoELayer) -> None:
    """megatron sets ``allreduce=False`` on expert weights (their gradients are reduced over the
    expert-data-parallel group, not the DP group) only in its own init path; we skip weight
    init, so make sure the attributes are there, and the TP ones of the experts' linears."""
    from parallel_models.llama.layers.linear import _mark_tensor_parallel

    for module in moe.experts.modules():
        for attr, dim in (("linear_fc1", 0), ("linear_fc2", 1)):
            sub = getattr(module, attr, None)
            if sub is not None:
                _mark_tensor_parallel(sub, dim)
        for p in module.parameters(recurse=False):
            p.allreduce = False
    for p in moe.experts.parameters():
        p.allreduce = False
    if moe.shared_experts is not None:
        _mark_tensor_parallel(moe.shared_experts.linear_fc1, 0)
        _mark_tensor_parallel(moe.shared_experts.linear_fc2, 1)
