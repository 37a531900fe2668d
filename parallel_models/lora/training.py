"""LoRA in a training run: adding the actor's (or the critic's) adapters with the trainable count
logged, and the merged weight sync of the hybrid engine (the rollout copy gets ``W + scale * B @ A``)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from parallel_models.lora.apply import model_chunks, adapters_merged, add_lora, lora_modules
from parallel_models.lora.config import LoraSettings
from parallel_models.lora.experts import ExpertLora
from parallel_models.lora.layers import ColumnLora

logger = logging.getLogger(__name__)


def adapter_parameter_count(model) -> int:
    """The trainable parameter count of the whole LoRA model, PEFT's count: each adapter matrix
    at its full size, every layer of every pipeline stage, and a value model's head (PEFT's
    ``modules_to_save``). Call on every rank."""
    local = 0
    for _, _, lora in lora_modules(model):
        if isinstance(lora, ExpertLora):
            local += lora.full_count()
            continue
        for ad in lora.adapters.values():
            a, b = ad.lora_A.weight.numel(), ad.lora_B.weight.numel()
            local += a + b * lora.tp if isinstance(lora, ColumnLora) else a * lora.tp + b
    chunks = model_chunks(model)
    local += sum(c.value_head.weight.numel() for c in chunks
                 if getattr(c, "value_head", None) is not None)
    layout = getattr(chunks[0], "parallel_layout", None)
    if layout is None or layout.pipeline_parallel_size == 1:
        return local
    total = torch.tensor([local], dtype=torch.int64, device=chunks[0].device)
    dist.all_reduce(total, group=layout.pp_group)
    return int(total.item())


def enable_lora(model, settings: LoraSettings, what: str = "actor") -> int:
    """Add ``settings``' adapters to ``model`` (base frozen, a value head trainable) and log
    the trainable parameter count (whole model) on global rank 0; returns that count."""
    add_lora(model, settings)
    count = adapter_parameter_count(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        head = " and the value head" if model_chunks(model)[0].head_kind == "value" else ""
        logger.info("%s: LoRA rank %d alpha %g on %s: %d trainable parameters (the adapters%s)",
                    what, settings.rank, settings.alpha, ",".join(settings.target_modules), count,
                    head)
    return count


class MergedWeightSync:
    """A hybrid engine's ``WeightSync`` that sends the merged weights: each ``sync`` runs inside
    :func:`~parallel_models.lora.apply.adapters_merged` on the actor (the targeted weights exist
    twice meanwhile); everything else is the wrapped sync's."""

    def __init__(self, sync, actor_chunks):
        self.inner = sync
        self.actor_chunks = actor_chunks

    def sync(self) -> float:
        with adapters_merged(self.actor_chunks):
            return self.inner.sync()

    def __getattr__(self, name):
        return getattr(self.inner, name)
