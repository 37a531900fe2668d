"""The rollout engine's TP' layout beside the training layout (TP x PP x EP x DP), in the same
processes: a second :class:`~parallel_models.parallel_layout.ParallelLayout` with groups of its
own, not a swap of megatron-core's globals.

Megatron-Bridge and verl's megatron workers keep one megatron layout per process and give the
rollout engine its own state (vLLM/SGLang have their own ``parallel_state``). Here the rollout
engine is our own model: :func:`build_rollout_layout` makes the TP' groups once (every rank,
collectively), the rollout model is built in that layout (``cls(config, layout=...)``) and keeps
it, so its layers, the LM head and the generation loop talk over the TP' groups while megatron's
globals (and everything built in the training layout) stay as ``init_parallel`` set them.

Rollout ranks: TP' groups are runs of TP' consecutive global ranks (megatron's order), so the
rollout data-parallel size is ``world / TP'``; rollout DP rank r' generates prompts
``j % DP' == r'`` of the batch (:func:`share_of`).
"""

from __future__ import annotations

import torch.distributed as dist

from parallel_models import distributed as pm_dist
from parallel_models.errors import ConfigError
from parallel_models.parallel_layout import ParallelLayout


def build_rollout_layout(tensor_parallel_size: int) -> ParallelLayout:
    """The rollout engine's TP' layout (PP = 1, no EP, no SP) over every rank of the default
    group. Build it on every rank at once (it creates process groups) after ``init_parallel``
    set up the training layout; megatron-core's globals are left as they are."""
    if not pm_dist.is_initialized():
        raise RuntimeError("build_rollout_layout: call parallel_models.init_parallel first (the "
                           "training layout)")
    world = dist.get_world_size()
    tp = tensor_parallel_size
    if not isinstance(tp, int) or tp < 1 or world % tp:
        raise ConfigError(f"rollout.tensor_parallel_size={tp!r} must divide the world size "
                          f"({world})")
    return ParallelLayout.tensor_parallel_only(tp, name="rollout")


def same_as_training(layout: ParallelLayout, training: ParallelLayout | None = None) -> bool:
    """Whether the rollout ``layout`` equals the training one (TP' = TP, PP = EP = CP = 1, no VPP):
    then the rollout engine can run on the actor's own weights (zero copy)."""
    s = pm_dist.training_layout() if training is None else training
    return (s.tensor_parallel_size == layout.tensor_parallel_size
            and s.pipeline_parallel_size == 1 and s.expert_parallel_size == 1
            and s.context_parallel_size == 1
            and not s.virtual_pipeline_parallel_size)


def share_of(items: list, rank: int, size: int) -> list[int]:
    """The indices of ``items`` that data-parallel rank ``rank`` of ``size`` takes (round robin)."""
    return [j for j in range(len(items)) if j % size == rank]


__all__ = ["build_rollout_layout", "same_as_training", "share_of"]
