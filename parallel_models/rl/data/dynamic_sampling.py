"""DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, section 3.2): a prompt whose
``rollout.n`` samples all get the same reward has zero group-relative advantage and trains
nothing, so such groups are dropped and more prompt batches are drawn until ``data.batch_size``
groups are kept (``algorithm.dynamic_sampling``; at most ``algorithm.max_gen_batches`` prompt
batches per step, 0 = no limit; past it the run stops with an error naming the setting).

A group is kept when its rewards (the training rewards, overlong shaping included: what the
advantages see) are not all equal, or when it has one sample (verl keeps those too); "equal" is
exact equality (verl's ``np.std(...) > 0`` can keep an all-equal group by rounding).

The kept set does not depend on the layout: the groups of each drawn batch are ordered by
(batch, place in the global prompt batch), the first ``data.batch_size`` kept ones form the
step, and they are dealt round-robin over the data-parallel ranks (the k-th to rank k % DP), as
the trainer deals prompts. Each rank draws its share of every prompt batch; the kept groups
travel between ranks (``all_gather_object`` over the data-parallel group) so every rank ends
with ``data.batch_size / DP`` of them. The prompt loader's position in a checkpoint counts every
batch drawn, and each extra batch's draw seeds are those of global prompt indices
``round * data.batch_size + i`` of the step (round 0: the plain step's), so a resumed run draws
the same samples.

Metrics: ``rollout/dynamic_generated`` (groups generated this step), ``rollout/dynamic_dropped``
(of those, the constant ones), ``rollout/dynamic_gen_batches`` (prompt batches drawn); the
step's other metrics (``reward/mean``, ...) are over the kept groups.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from parallel_models.rl.data.batch import RolloutBatch


def group_rows(group_index: torch.Tensor) -> list[list[int]]:
    """The rows of each group, groups in the order of their first row."""
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(group_index.tolist()):
        groups.setdefault(g, []).append(row)
    return list(groups.values())


def varies(scores: torch.Tensor, rows: list[int]) -> bool:
    """Whether the group of ``rows`` trains: its rewards differ (or it has one sample)."""
    values = scores[rows]
    return len(rows) == 1 or bool(values.max() != values.min())


def _gather(obj, dp_size: int, group) -> list:
    if dp_size == 1:
        return [obj]
    parts: list = [None] * dp_size
    dist.all_gather_object(parts, obj, group=group)
    return parts


def collect_groups(draw: Callable[[int], tuple[RolloutBatch, list[int]]], batch_size: int,
                   max_gen_batches: int, dp_rank: int = 0, dp_size: int = 1, group=None
                   ) -> tuple[RolloutBatch, dict[str, float]]:
    """This rank's share of the step's ``batch_size`` kept groups and the metrics.

    ``draw(round)`` rolls out and scores this rank's share of the next prompt batch: it returns
    the batch (``scores`` set) and the global index of each of its groups (in the order of their
    first row). ``group`` is the data-parallel process group (``dp_size`` ranks)."""
    kept: list[tuple[int, int, RolloutBatch]] = []
    generated = dropped = rounds = 0
    device = None
    while len(kept) < batch_size:
        if max_gen_batches and rounds >= max_gen_batches:
            raise RuntimeError(
                f"algorithm.dynamic_sampling: {len(kept)} of data.batch_size={batch_size} groups "
                f"with differing rewards after algorithm.max_gen_batches={max_gen_batches} "
                f"prompt batches ({generated} groups drawn, {dropped} with one reward for all "
                "samples); the reward does not tell this policy's samples apart: check the "
                "reward, raise algorithm.max_gen_batches (0 = no limit) or turn "
                "algorithm.dynamic_sampling off")
        batch, global_indices = draw(rounds)
        device = batch.sequences.device
        groups = group_rows(batch.group_index)
        if len(groups) != len(global_indices):
            raise ValueError(f"dynamic sampling: {len(groups)} groups in the rollout for "
                             f"{len(global_indices)} prompts")
        mine = []
        for rows, index in zip(groups, global_indices):
            if varies(batch.scores, rows):
                piece = batch.select(rows).to("cpu")
                piece.group_index = torch.zeros_like(piece.group_index)
                mine.append((rounds, index, piece))
        counts = _gather((len(groups), len(groups) - len(mine), mine), dp_size, group)
        generated += sum(c[0] for c in counts)
        dropped += sum(c[1] for c in counts)
        kept += sorted((p for c in counts for p in c[2]), key=lambda p: (p[0], p[1]))
        rounds += 1
    share = [piece for k, (_, _, piece) in enumerate(kept[:batch_size]) if k % dp_size == dp_rank]
    metrics = {"rollout/dynamic_generated": float(generated),
               "rollout/dynamic_dropped": float(dropped),
               "rollout/dynamic_gen_batches": float(rounds)}
    return RolloutBatch.concat(share).to(device), metrics


__all__ = ["group_rows", "varies", "collect_groups"]
