"""MoE dispatch without expert parallelism that never leaves the device, for forwards without
autograd: the decode steps the rollout engines capture in CUDA graphs, and scoring.

megatron-core's all-to-all token dispatcher copies the per-expert token counts to the host
(0.19: a non-blocking copy on a side stream; 0.16 also sorts the tokens with ``masked_select``),
and a CUDA graph cannot capture either, so an MoE model's decode step ran eagerly. When the
experts are not split over ranks (EP = 1, TP = 1) the dispatch needs no communication: this is
the same permutation, expert call and combine as megatron-core's (its ``unpermute``; the
tokens sorted expert-major, token order within an expert, as its ``permute`` sorts them) with
fixed shapes (``tokens x top-k`` routed rows) and the counts left on the device. Same values
bit for bit, so exact mode's training forward (megatron's dispatcher, autograd on) and its
rollout (this path) still agree. The option ``moe_device_dispatch`` off
(``PARALLEL_MODELS_MOE_DEVICE_DISPATCH=0``) keeps megatron-core's dispatcher everywhere
(benchmarks compare).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_utils import unpermute

from parallel_models.options import option


def applies(moe, hidden: torch.Tensor) -> bool:
    """Whether ``moe`` (a megatron-core ``MoELayer``) can run :func:`forward` on ``hidden``:
    no autograd, experts neither expert- nor tensor-parallel, dropless, no latent projection."""
    cfg = moe.config
    if not option("moe_device_dispatch"):
        return False
    if torch.is_grad_enabled() and hidden.requires_grad:
        return False
    if getattr(moe, "shared_expert_overlap", False) or getattr(cfg, "moe_latent_size", None):
        return False
    if cfg.moe_expert_capacity_factor is not None or cfg.moe_pad_expert_input_to_capacity:
        return False
    return (moe.num_local_experts == cfg.num_moe_experts
            and moe.parallel_layout.tensor_parallel_size == 1
            and moe.parallel_layout.expert_tensor_parallel_size == 1)


def forward(moe, hidden: torch.Tensor) -> torch.Tensor:
    """``moe``'s output for ``hidden [tokens, batch, hidden]`` (see the module doc)."""
    shared = moe.shared_experts(hidden) if moe.use_shared_expert else None
    probs, routing_map = moe.router(hidden)
    flat = hidden.reshape(-1, hidden.shape[-1])
    tokens = routing_map.shape[0]
    routed = tokens * moe.config.moe_router_topk  # every token goes to exactly top-k experts
    # the True entries of the [experts, tokens] map in row-major order: what masked_select gives
    order = routing_map.T.reshape(-1).argsort(descending=True, stable=True)[:routed]
    sorted_indices = order % tokens
    permuted_probs = probs.T.contiguous().reshape(-1)[order]
    permuted = flat.index_select(0, sorted_indices)
    out, bias = moe.experts(permuted, routing_map.sum(dim=0), permuted_probs)
    if bias is not None:
        raise ValueError("MoE experts with a bias are not supported")
    out = unpermute(out, sorted_indices, flat.shape, routing_map=routing_map).view(hidden.shape)
    return out if shared is None else out + shared
