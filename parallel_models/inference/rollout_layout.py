"""A second megatron-core parallel layout in the same processes: the rollout engine's TP' layout
beside the training layout (TP x PP x EP x DP).

megatron-core keeps its process groups in module globals of ``parallel_state``; our layers read
them while they are built (megatron's linears keep their ``tp_group``) and some code reads them at
call time (the LM head's vocab gather, generation's token broadcast, ``get_parallel_settings``).
Megatron-Bridge and verl's megatron workers keep one megatron layout per process and give the
rollout engine its own state (vLLM/SGLang have their own ``parallel_state``). Here the rollout
engine is our own model, so the two layouts are two *snapshots* of megatron's globals (and of
``parallel_models.distributed``'s settings): :class:`RolloutLayout` builds the TP' groups once
(every rank, collectively) and :meth:`RolloutLayout.active` swaps them in for a block (building
the rollout model, generating), restoring the training layout after, also on error.

Rollout ranks: TP' groups are runs of TP' consecutive global ranks (megatron's order), so the
rollout data-parallel size is ``world / TP'``; rollout DP rank r' generates prompts
``j % DP' == r'`` of the batch (:func:`share_of`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch.distributed as dist
from megatron.core import parallel_state as mpu

from parallel_models import distributed as pm_dist
from parallel_models.errors import ConfigError


def _state_names() -> list[str]:
    """megatron's parallel_state globals: every module-level ``_UPPER_CASE`` name that is data
    (groups, ranks, sizes, caches), not a function or a module."""
    out = []
    for name, value in vars(mpu).items():
        if name.startswith("_") and name[1:2].isupper() and name.upper() == name \
                and not callable(value) and not isinstance(value, type(mpu)):
            out.append(name)
    return out


@dataclasses.dataclass
class ParallelStateSnapshot:
    """megatron-core's parallel_state globals and our ParallelSettings at one moment."""

    values: dict
    settings: object

    @classmethod
    def take(cls) -> "ParallelStateSnapshot":
        return cls({name: getattr(mpu, name) for name in _state_names()}, pm_dist._SETTINGS)

    def restore(self) -> None:
        for name, value in self.values.items():
            setattr(mpu, name, value)
        pm_dist._SETTINGS = self.settings

    @staticmethod
    def clear() -> None:
        """Every global back to "not initialized" (None; dict caches empty), without destroying
        any group (the snapshot keeps them)."""
        for name in _state_names():
            setattr(mpu, name, {} if isinstance(getattr(mpu, name), dict) else None)
        pm_dist._SETTINGS = None


class RolloutLayout:
    """The rollout engine's TP' layout (PP=1, no EP) over every rank of the default group.

    Build it on every rank at once (it creates process groups) after ``init_parallel`` set up
    the training layout; the training layout stays active outside :meth:`active`."""

    def __init__(self, tensor_parallel_size: int):
        if not pm_dist.is_initialized():
            raise RuntimeError("RolloutLayout: call parallel_models.init_parallel first (the "
                               "training layout)")
        world = dist.get_world_size()
        tp = tensor_parallel_size
        if tp < 1 or world % tp:
            raise ConfigError(f"rollout.tensor_parallel_size={tp} must divide the world size "
                              f"({world})")
        self.tensor_parallel_size = tp
        self.data_parallel_size = world // tp
        rank = dist.get_rank()
        self.tensor_parallel_rank = rank % tp
        self.data_parallel_rank = rank // tp
        self._training = ParallelStateSnapshot.take()
        try:
            ParallelStateSnapshot.clear()
            mpu.initialize_model_parallel(tensor_model_parallel_size=tp,
                                          create_gloo_process_groups=False)
            pm_dist._SETTINGS = pm_dist.ParallelSettings(
                tensor_parallel_size=tp, pipeline_parallel_size=1,
                virtual_pipeline_parallel_size=None, data_parallel_size=world // tp,
                sequence_parallel=False, expert_parallel_size=1)
            self._rollout = ParallelStateSnapshot.take()
        finally:
            self._training.restore()
        self._depth = 0

    @contextlib.contextmanager
    def active(self):
        """The rollout layout for a block (re-entrant); the training layout again after it."""
        if self._depth:
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        outer = ParallelStateSnapshot.take()
        self._rollout.restore()
        self._depth = 1
        try:
            yield self
        finally:
            self._depth = 0
            outer.restore()

    @property
    def tensor_parallel_group(self):
        return self._rollout.values["_TENSOR_MODEL_PARALLEL_GROUP"]

    def same_as_training(self) -> bool:
        """Whether the rollout layout equals the training one (TP' = TP, PP = EP = 1): then the
        rollout engine can run on the actor's own weights (zero copy)."""
        s = self._training.settings
        return (s.tensor_parallel_size == self.tensor_parallel_size
                and s.pipeline_parallel_size == 1 and s.expert_parallel_size == 1
                and not s.virtual_pipeline_parallel_size)


def share_of(items: list, rank: int, size: int) -> list[int]:
    """The indices of ``items`` that data-parallel rank ``rank`` of ``size`` takes (round robin)."""
    return [j for j in range(len(items)) if j % size == rank]


__all__ = ["ParallelStateSnapshot", "RolloutLayout", "share_of"]
