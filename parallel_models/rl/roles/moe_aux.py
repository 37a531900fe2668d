"""The MoE load-balancing (router auxiliary) loss in the actor update: transformers' convention
(``output_router_logits``: ``loss + router_aux_loss_coef * aux_loss``), with the loss computed
exactly as transformers does by ``llama.layers.moe_aux_loss``.

``actor.moe_aux_loss_coef`` picks the weight: null = the model config's ``router_aux_loss_coef``,
0 = off. Each microbatch's forward records its router logits; the loss function adds
``coef * aux`` of that microbatch (weighted like the policy loss, by the microbatch's loss
denominator, so the step's loss is the weighted mean over microbatches and data-parallel ranks)
and reports it as ``actor/moe_aux_loss``.

Pipeline parallel: the loss function runs on the last stage, which receives the earlier stages'
router totals with each microbatch's activation (``llama.layers.moe_aux_carry``); the gradient
reaches every stage's routers, exactly as at PP=1.
"""

from __future__ import annotations

import contextlib

from parallel_models.llama.layers import moe_aux_loss

METRIC = "moe_aux_loss"


def aux_loss_coef(actor_cfg, model_config) -> float:
    """The weight of the load-balancing loss in the actor's loss (0.0: off; always 0 for a
    dense model)."""
    if not getattr(model_config, "is_moe", False):
        return 0.0
    explicit = getattr(actor_cfg, "moe_aux_loss_coef", None)
    return float(model_config.router_aux_loss_coef if explicit is None else explicit)


@contextlib.contextmanager
def recording(chunks, coef: float):
    """Routers keep their logits while the block runs (only when ``coef`` > 0)."""
    if coef <= 0:
        yield
        return
    moe_aux_loss.record_router_logits(chunks, True)
    try:
        yield
    finally:
        moe_aux_loss.record_router_logits(chunks, False)


def with_aux_loss(loss_fn, model, coef: float):
    """``loss_fn`` (returning ``(loss * denom, denom, metrics)``) plus ``coef`` times the
    load-balancing loss of the forward of ``model`` (ours or its DDP wrapper; this rank's
    pipeline chunk or chunks) it is called after; unchanged when ``coef`` is 0."""
    if coef <= 0:
        return loss_fn

    def fn(out, mb):
        loss, denom, metrics = loss_fn(out, mb)
        aux = moe_aux_loss.load_balancing_loss(model)
        metrics[METRIC] = aux.detach() * denom
        return loss + coef * aux * denom, denom, metrics

    return fn
