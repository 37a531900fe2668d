"""The MoE load-balancing (router auxiliary) loss in the actor update: transformers' convention
(``output_router_logits``: ``loss + router_aux_loss_coef * aux_loss``), with the loss computed
exactly as transformers does by ``llama.layers.moe_aux_loss``.

``actor.moe_aux_loss_coef`` picks the weight: null = the model config's ``router_aux_loss_coef``,
0 = off. Each microbatch's forward records its router logits; the loss function adds
``coef * aux`` of that microbatch (weighted like the policy loss, by the microbatch's loss
denominator, so the step's loss is the weighted mean over microbatches and data-parallel ranks)
and reports it as ``actor/moe_aux_loss``.

Pipeline parallel: the aux loss reduces its counts over the pipeline group, which the loss
function (run on the last stage only) cannot do; with PP > 1 an explicit coefficient is refused
and the model's default is not applied (a warning says so).
"""

from __future__ import annotations

import contextlib
import logging

from megatron.core import parallel_state as mpu

from parallel_models.errors import ConfigError
from parallel_models.llama.layers import moe_aux_loss

logger = logging.getLogger(__name__)

METRIC = "moe_aux_loss"


def aux_loss_coef(actor_cfg, model_config) -> float:
    """The weight of the load-balancing loss in the actor's loss (0.0: off; always 0 for a
    dense model)."""
    if not getattr(model_config, "is_moe", False):
        return 0.0
    explicit = getattr(actor_cfg, "moe_aux_loss_coef", None)
    coef = float(model_config.router_aux_loss_coef if explicit is None else explicit)
    if coef > 0 and mpu.get_pipeline_model_parallel_world_size() > 1:
        if explicit is not None:
            raise ConfigError(f"actor.moe_aux_loss_coef={explicit}: the MoE load-balancing loss "
                              "is not supported with parallel.pipeline_parallel_size > 1; set "
                              "actor.moe_aux_loss_coef=0")
        logger.warning("the model's router_aux_loss_coef (%s) is not applied with pipeline "
                       "parallel (set actor.moe_aux_loss_coef=0 to silence this)", coef)
        return 0.0
    return coef


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
    load-balancing loss of the forward of ``model`` (ours, not its DDP wrapper; one pipeline
    stage) it is called after; unchanged when ``coef`` is 0."""
    if coef <= 0:
        return loss_fn

    def fn(out, mb):
        loss, denom, metrics = loss_fn(out, mb)
        aux = moe_aux_loss.load_balancing_loss(model)
        metrics[METRIC] = aux.detach() * denom
        return loss + coef * aux * denom, denom, metrics

    return fn
