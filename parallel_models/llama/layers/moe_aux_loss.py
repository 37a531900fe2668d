"""The load-balancing (router auxiliary) loss of the MoE families, computed as transformers'
``load_balancing_loss_func`` does (Qwen2-MoE, Qwen3-MoE and Mixtral share it):

    loss = E * sum_e (tokens routed to e / R) * (sum of softmax probs of e / R)

over every MoE layer and real token at once (R = layers x tokens; top-k assignments counted per
expert). It is off by default: ``record_router_logits(model, True)`` makes the routers keep their
logits; after a forward, ``load_balancing_loss(model)`` returns the loss of that forward and
clears the records. The trainer adds ``config.router_aux_loss_coef`` times it to its loss.

Distributed: under sequence parallel each TP rank routes its share of the tokens, and under
pipeline parallel each stage owns some layers, so the counts, probability sums and row counts are
summed over the TP and pipeline groups. The returned value is the whole model's loss on every
rank; its gradient reaches this rank's router logits exactly (the counts are constants, as in
transformers, where top-k has no gradient). With PP > 1 only the stage that calls ``backward`` on
it gets that gradient: add it on the last stage to train the last stage's routers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from parallel_models.llama.layers.moe import RecordingTopKRouter


def _routers(model) -> list[RecordingTopKRouter]:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for c in chunks for m in c.modules() if isinstance(m, RecordingTopKRouter)]


def record_router_logits(model, enabled: bool = True) -> None:
    """Start (or stop) keeping the router logits of every MoE layer of ``model`` (one model or
    its pipeline chunks)."""
    for router in _routers(model):
        router.recording = [] if enabled else None


def load_balancing_loss(model, valid_tokens: int | None = None) -> torch.Tensor:
    """transformers' load-balancing loss of the last forward of ``model`` (see the module doc).

    ``valid_tokens``: the real token count of that forward (rows past it are sequence-parallel
    padding); default: what the model recorded (``model.last_token_count``)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    first = chunks[0]
    config = first.config
    routers = _routers(model)
    if any(r.recording is None for r in routers):
        raise RuntimeError("load_balancing_loss: router logits are not being recorded; call "
                           "record_router_logits(model, True) before the forward")
    num_experts, top_k = config.num_experts, config.moe_top_k
    if valid_tokens is None:
        valid_tokens = getattr(first, "last_token_count", None)
    sp = first.sequence_parallel
    tp_rank = mpu.get_tensor_model_parallel_rank() if sp else 0
    device = next(first.parameters()).device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros(1, dtype=torch.float32, device=device)
    for router in routers:
        for logits in router.recording:
            n = logits.shape[0]
            start = tp_rank * n  # this rank's rows of the (SP-split) token sequence
            real = n if valid_tokens is None else max(0, min(n, valid_tokens - start))
            weights = torch.softmax(logits[:real].float(), dim=-1)
            chosen = weights.topk(top_k, dim=-1).indices.reshape(-1)
            counts += torch.bincount(chosen, minlength=num_experts).float()
            probs = probs + weights.sum(dim=0)
            rows += real
        router.recording = []
    totals = torch.cat([counts, probs.detach(), rows])
    groups = []
    if sp and mpu.get_tensor_model_parallel_world_size() > 1:
        groups.append(mpu.get_tensor_model_parallel_group())
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        groups.append(mpu.get_pipeline_model_parallel_group())
    for group in groups:
        dist.all_reduce(totals, group=group)
    counts_all, probs_all, rows_all = totals.split([num_experts, num_experts, 1])
    rows_all = rows_all.clamp_min(1.0)
    value = num_experts * (counts_all / rows_all * probs_all / rows_all).sum()
    local = num_experts * (counts_all / rows_all * probs / rows_all).sum()
    return local + (value - local).detach()
