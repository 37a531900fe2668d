"""An explicit parallel layout: the sizes, ranks and process groups one model is built in.

megatron-core keeps one layout per process in ``parallel_state``'s module globals. A
:class:`ParallelLayout` is a value instead: the sizes (TP, SP flag, PP, VPP, EP, DP) and
megatron-core's own :class:`~megatron.core.process_groups_config.ProcessGroupCollection` of
groups (``tp``, ``pp``, ``dp``, ``ep``, ``expt_tp``, ...), passed where models, layers and
engines are built; they keep it and read groups and ranks from it at call time.

Two kinds exist in a process:

- the **training layout** (:meth:`ParallelLayout.from_parallel_state`): megatron's own groups as
  ``parallel_models.init_parallel`` set them up (megatron's schedules, DDP, optimizer and
  checkpoint code still read its globals, so the training layout is the same groups);
- a **tensor-parallel-only layout** (:meth:`ParallelLayout.tensor_parallel_only`, the rollout
  engine's TP', PP = EP = 1): new groups made collectively with ``torch.distributed``, leaving
  megatron's globals untouched. TP' groups are runs of TP' consecutive global ranks (megatron's
  order), the data-parallel groups take every TP'-th rank.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

# the groups a layout carries (ProcessGroupCollection field names); megatron's MoE layer reads
# tp, cp, ep, expt_tp, expt_dp, tp_ep, tp_cp and tp_dp_cp
GROUP_NAMES = ("tp", "pp", "mp", "cp", "tp_cp", "ep", "expt_tp", "tp_ep", "tp_ep_pp", "embd",
               "dp", "dp_cp", "expt_dp", "tp_dp_cp")


def _collection_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(ProcessGroupCollection)}


def _megatron_groups() -> ProcessGroupCollection:
    """megatron-core's current globals as a ProcessGroupCollection (its own constructor; only the
    names this megatron-core version knows)."""
    names = [n for n in GROUP_NAMES if n in _collection_fields()]
    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=names)


def _subgroups(partition: list[list[int]]):
    """This rank's group of a partition of the world's ranks; every rank calls this with the same
    partition (each group is created collectively)."""
    mine = None
    rank = dist.get_rank()
    for ranks in partition:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


@dataclasses.dataclass(frozen=True, eq=False)
class ParallelLayout:
    """Sizes and groups of one parallel layout (field names as ``ParallelSettings``'s)."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    virtual_pipeline_parallel_size: int | None
    data_parallel_size: int
    sequence_parallel: bool
    expert_parallel_size: int
    groups: ProcessGroupCollection
    name: str = "training"
    context_parallel_size: int = 1  # CP: each sequence split over the ranks of groups.cp

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_parallel_state(cls, *, sequence_parallel: bool,
                            virtual_pipeline_parallel_size: int | None) -> "ParallelLayout":
        """The layout of megatron-core's ``parallel_state`` as initialized now (the training
        layout; ``init_parallel`` builds it)."""
        groups = _megatron_groups()
        tp, pp, cp = groups.tp.size(), groups.pp.size(), groups.cp.size()
        return cls(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                   virtual_pipeline_parallel_size=virtual_pipeline_parallel_size,
                   data_parallel_size=dist.get_world_size() // (tp * pp * cp),
                   sequence_parallel=bool(sequence_parallel and tp > 1),
                   expert_parallel_size=groups.ep.size(), groups=groups, name="training",
                   context_parallel_size=cp)

    @classmethod
    def tensor_parallel_only(cls, tensor_parallel_size: int,
                             name: str = "rollout") -> "ParallelLayout":
        """A TP-only layout (PP = EP = 1, no SP) over every rank of the default group, with groups
        of its own. Call on every rank at once (it creates process groups); megatron-core's
        globals are not read or changed."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelLayout.tensor_parallel_only: torch.distributed is not "
                               "initialized; call parallel_models.init_parallel first")
        world, tp = dist.get_world_size(), tensor_parallel_size
        if not isinstance(tp, int) or tp < 1 or world % tp:
            raise ValueError(f"tensor_parallel_size={tp!r} must be a positive divisor of the "
                             f"world size ({world})")
        tp_group = _subgroups([list(range(s, s + tp)) for s in range(0, world, tp)])
        dp_group = _subgroups([list(range(r, world, tp)) for r in range(tp)])
        one = _subgroups([[r] for r in range(world)])  # the size-1 roles (PP, EP, CP)
        everyone = _subgroups([list(range(world))])
        groups = ProcessGroupCollection(
            tp=tp_group, pp=one, mp=tp_group, cp=one, tp_cp=tp_group, ep=one, expt_tp=tp_group,
            tp_ep=tp_group, tp_ep_pp=tp_group, embd=one, dp=dp_group, dp_cp=dp_group,
            expt_dp=dp_group, tp_dp_cp=everyone)
        return cls(tensor_parallel_size=tp, pipeline_parallel_size=1,
                   virtual_pipeline_parallel_size=None, data_parallel_size=world // tp,
                   sequence_parallel=False, expert_parallel_size=1, groups=groups, name=name)

    # ---- groups ---------------------------------------------------------------------------------
    @property
    def tp_group(self):
        return self.groups.tp

    @property
    def pp_group(self):
        return self.groups.pp

    @property
    def dp_group(self):
        return self.groups.dp

    @property
    def ep_group(self):
        return self.groups.ep

    @property
    def cp_group(self):
        return self.groups.cp

    @property
    def expert_tp_group(self):
        return self.groups.expt_tp

    # ---- ranks ----------------------------------------------------------------------------------
    @property
    def tensor_parallel_rank(self) -> int:
        return self.groups.tp.rank()

    @property
    def pipeline_parallel_rank(self) -> int:
        return self.groups.pp.rank()

    @property
    def data_parallel_rank(self) -> int:
        return self.groups.dp.rank()

    @property
    def context_parallel_rank(self) -> int:
        return self.groups.cp.rank()

    @property
    def expert_parallel_rank(self) -> int:
        return self.groups.ep.rank()

    @property
    def expert_tensor_parallel_size(self) -> int:
        return self.groups.expt_tp.size()

    @property
    def expert_tensor_parallel_rank(self) -> int:
        return self.groups.expt_tp.rank()

    @property
    def tensor_parallel_src_rank(self) -> int:
        """The global rank of TP rank 0 of this rank's TP group (broadcast source)."""
        return dist.get_global_rank(self.groups.tp, 0)

    @property
    def pipeline_last_rank(self) -> int:
        """The global rank of the last pipeline stage of this rank's pipeline group."""
        return dist.get_global_rank(self.groups.pp, self.pipeline_parallel_size - 1)

    def is_pipeline_first_stage(self) -> bool:
        return self.pipeline_parallel_rank == 0

    def is_pipeline_last_stage(self) -> bool:
        return self.pipeline_parallel_rank == self.pipeline_parallel_size - 1

    def moe_groups(self) -> ProcessGroupCollection:
        """The collection megatron-core's ``MoELayer`` takes as ``pg_collection``."""
        return self.groups

    def __repr__(self) -> str:
        return (f"ParallelLayout({self.name}: TP={self.tensor_parallel_size}"
                f"{' (SP)' if self.sequence_parallel else ''} PP={self.pipeline_parallel_size}"
                f" VPP={self.virtual_pipeline_parallel_size or 1} EP={self.expert_parallel_size}"
                f"{f' CP={self.context_parallel_size}' if self.context_parallel_size > 1 else ''}"
                f" DP={self.data_parallel_size})")


def layout_of(model) -> ParallelLayout:
    """The layout ``model`` (one chunk, or a list of chunks) was built with."""
    if isinstance(model, (list, tuple)):
        model = model[0]
    while not hasattr(model, "parallel_layout") and hasattr(model, "module"):
        model = model.module  # megatron DDP / Float16Module wrappers
    return model.parallel_layout


__all__ = ["GROUP_NAMES", "ParallelLayout", "layout_of"]
