"""The load-balancing (router auxiliary) loss of the MoE families, computed as transformers'
``load_balancing_loss_func`` does (Qwen2-MoE, Qwen3-MoE and Mixtral share it):

    loss = E * sum_e (C_e / R) * (P_e / R)

over every MoE layer and real token of one forward at once: C_e = top-k assignments of expert e
(constants: top-k has no gradient, in transformers either), P_e = sum of the softmax router
probabilities of e (differentiable), R = layers x tokens.

It is off by default: ``record_router_logits(model, True)`` makes the routers keep their logits;
at the end of each forward the model folds them into :class:`RouterTotals` (:func:`collect`,
called by ``ParallelModel.forward_hidden``); ``load_balancing_loss(model)`` then returns the loss
of that forward. The trainer adds ``config.router_aux_loss_coef`` times it to its loss.

Distributed:
- sequence parallel: each TP rank routes its share of the tokens; the loss sums the totals over
  the TP group, and the gradient reaches each rank's router logits exactly;
- pipeline parallel (virtual chunks too): each stage owns some layers, and the loss is a product
  of sums over all of them, so no collective can compute it inside a forward that megatron's
  schedules run on the stages at different times. Instead the running totals ride to the next
  stage with the activation (``moe_aux_carry``); the last stage holds the whole model's totals
  and computes the loss, and its gradient w.r.t. the probability sums (E * C / R^2, the loss is
  linear in P) travels back with the activation gradient to every earlier stage's routers;
- expert parallel changes nothing: every rank routes its own tokens over all experts.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from parallel_models.llama.layers.moe import RecordingTopKRouter
from parallel_models.parallel_layout import ParallelLayout, layout_of


@dataclasses.dataclass
class RouterTotals:
    """The sums the loss needs over the MoE layers seen so far in one forward (this TP rank's
    tokens under sequence parallel): ``counts [E]`` top-k assignments per expert and ``rows [1]``
    routed token rows (int64, no gradient); ``probs [E]`` softmax probability sums (fp32,
    differentiable)."""

    counts: torch.Tensor
    probs: torch.Tensor
    rows: torch.Tensor

    @classmethod
    def zeros(cls, num_experts: int, device) -> "RouterTotals":
        return cls(torch.zeros(num_experts, dtype=torch.int64, device=device),
                   torch.zeros(num_experts, dtype=torch.float32, device=device),
                   torch.zeros(1, dtype=torch.int64, device=device))


def _routers(model) -> list[RecordingTopKRouter]:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for c in chunks for m in c.modules() if isinstance(m, RecordingTopKRouter)]


def _models(model) -> list:
    """Our model chunks inside ``model`` (one model, its DDP wrapper, or a list of chunks)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for c in chunks for m in c.modules() if hasattr(m, "moe_aux_recording")]


def record_router_logits(model, enabled: bool = True) -> None:
    """Start (or stop) keeping the router logits of every MoE layer of ``model`` (one model or
    its pipeline chunks), and with them the totals each forward collects."""
    for router in _routers(model):
        router.recording = [] if enabled else None
    for m in _models(model):
        m.moe_aux_recording = enabled
        m.moe_aux_totals = None


def is_recording(model) -> bool:
    return bool(getattr(model, "moe_aux_recording", False))


def _fold(routers, totals: RouterTotals, valid_tokens: int | None, tp_rank: int, top_k: int
          ) -> RouterTotals:
    """``totals`` plus the recorded logits of ``routers`` (in layer order), which are cleared.
    Rows past ``valid_tokens`` (sequence-parallel or pipeline padding) are left out."""
    counts, probs, rows = totals.counts, totals.probs, totals.rows
    for router in routers:
        for logits in router.recording:
            n = logits.shape[0]
            start = tp_rank * n  # this rank's rows of the (SP-split) token sequence
            real = n if valid_tokens is None else max(0, min(n, valid_tokens - start))
            weights = torch.softmax(logits[:real].float(), dim=-1)
            chosen = weights.topk(top_k, dim=-1).indices.reshape(-1)
            # scatter_add, not bincount: no device sync (bincount sizes its output on the host)
            counts = counts.scatter_add(0, chosen, torch.ones_like(chosen))
            probs = probs + weights.sum(dim=0)
            rows = rows + real
        router.recording = []
    return RouterTotals(counts, probs, rows)


def _tp_rank(model) -> int:
    return layout_of(model).tensor_parallel_rank if model.sequence_parallel else 0


def collect(model, incoming: RouterTotals | None = None) -> RouterTotals:
    """At the end of a forward of ``model`` (one chunk): ``incoming`` (the earlier pipeline
    stages' totals; none on the first) plus this chunk's recorded router logits, whose real
    rows are the first ``model.last_token_count`` tokens."""
    config = model.config
    if incoming is None:
        incoming = RouterTotals.zeros(config.num_experts, next(model.parameters()).device)
    return _fold(_routers(model), incoming, getattr(model, "last_token_count", None),
                 _tp_rank(model), config.moe_top_k)


def load_balancing_loss(model, valid_tokens: int | None = None) -> torch.Tensor:
    """transformers' load-balancing loss of the last forward of ``model`` (one model or its
    pipeline chunks; see the module doc). With pipeline parallel, call it on the last stage.

    ``valid_tokens``: only for logits still recorded, i.e. routers run outside the model's own
    forward (rows past it are padding; default ``model.last_token_count``)."""
    chunks = _models(model)
    routers = _routers(model)
    if not chunks or any(r.recording is None for r in routers) or \
            not all(is_recording(c) for c in chunks):
        raise RuntimeError("load_balancing_loss: router logits are not being recorded; call "
                           "record_router_logits(model, True) before the forward")
    first = chunks[0]
    num_experts = first.config.num_experts
    pending = [c.moe_aux_totals for c in chunks if c.moe_aux_totals is not None]
    for c in chunks:
        c.moe_aux_totals = None
    if not pending and layout_of(first).pipeline_parallel_size > 1 and \
            not any(c.post_process for c in chunks):
        raise RuntimeError("load_balancing_loss: with pipeline parallel the loss is computed on "
                           "the last stage (the earlier stages' totals travel to it with the "
                           "activations)")
    totals = pending[0] if pending else RouterTotals.zeros(num_experts, first.device)
    for extra in pending[1:]:
        totals = RouterTotals(totals.counts + extra.counts, totals.probs + extra.probs,
                              totals.rows + extra.rows)
    if valid_tokens is None:
        valid_tokens = getattr(first, "last_token_count", None)
    totals = _fold(routers, totals, valid_tokens, _tp_rank(first), first.config.moe_top_k)
    return _loss(totals, num_experts, first.sequence_parallel, layout_of(first))


def _loss(totals: RouterTotals, num_experts: int, sequence_parallel: bool,
          layout: ParallelLayout) -> torch.Tensor:
    """The loss of whole-model totals (this TP rank's share under sequence parallel): its value
    is that of the totals summed over the TP group; its gradient reaches this rank's ``probs``
    as E * C / R^2 (C, R of the whole group)."""
    probs = totals.probs
    summed = torch.cat([totals.counts.double(), probs.detach().double(), totals.rows.double()])
    if sequence_parallel and layout.tensor_parallel_size > 1:
        dist.all_reduce(summed, group=layout.tp_group)
    counts_all, probs_all, rows_all = summed.float().split([num_experts, num_experts, 1])
    rows_all = rows_all.clamp_min(1.0)
    value = num_experts * (counts_all / rows_all * probs_all / rows_all).sum()
    local = num_experts * (counts_all / rows_all * probs / rows_all).sum()
    return local + (value - local).detach()
