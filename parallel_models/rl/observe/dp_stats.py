"""Batch statistics global over the data-parallel group.

Each data-parallel rank holds its share of the PPO batch. Anything that normalizes by a batch
statistic (advantage whitening, the KL fed to the adaptive controller, loss metrics) must use
the statistic of the *global* batch, or DP=2 trains differently from DP=1 on the same data.
With one data-parallel rank (or no process group) every function here is the plain
single-process computation of :mod:`parallel_models.rl.algorithms.core`, bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from parallel_models.rl.algorithms import core as algos


def _dp_group():
    """The data-parallel group, or None when there is nothing to reduce over."""
    if not dist.is_initialized() or not mpu.model_parallel_is_initialized():
        return None
    if mpu.get_data_parallel_world_size() == 1:
        return None
    return mpu.get_data_parallel_group()


def data_parallel_sum(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over the data-parallel ranks (float64 on the wire, original device and
    dtype back)."""
    group = _dp_group()
    if group is None:
        return values
    wire = values.detach().to(torch.float64)
    if torch.cuda.is_available():
        wire = wire.cuda()
    dist.all_reduce(wire, group=group)
    return wire.to(device=values.device, dtype=values.dtype)


def data_parallel_max(values: torch.Tensor) -> float:
    """The largest element of ``values`` over every rank (``-data_parallel_max(-x)`` is the
    smallest)."""
    top = values.detach().max().to(torch.float64).reshape(1)
    group = _dp_group()
    if group is not None:
        if torch.cuda.is_available():
            top = top.cuda()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    return float(top[0])


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`algorithms.masked_whiten` with the mean and (unbiased) variance of the valid
    positions of every data-parallel rank's ``x`` together (two passes, like the local one)."""
    if _dp_group() is None:
        return algos.masked_whiten(x, mask)
    m = algos.as_bool_mask(mask, x)
    stats = data_parallel_sum(torch.stack([algos.masked_sum(x, m), m.sum().to(x.dtype)]))
    total, count = stats[0], stats[1]
    mean = total / count.clamp_min(1)
    sq = data_parallel_sum(algos.masked_sum((x - mean) ** 2, m).reshape(1))[0]
    var = torch.where(count > 1, sq / (count - 1).clamp_min(1), torch.zeros_like(sq))
    whitened = (x - mean) * torch.rsqrt(var + algos.WHITEN_EPS)
    return torch.where(m, whitened, torch.zeros_like(whitened))


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``x`` over the valid positions of every rank."""
    m = algos.as_bool_mask(mask, x)
    stats = data_parallel_sum(torch.stack([algos.masked_sum(x, m).double(),
                                           m.sum().double()]))
    return float(stats[0] / stats[1].clamp_min(1))


def row_mean(values: torch.Tensor) -> float:
    """Mean of a per-row tensor over the rows of every rank."""
    stats = data_parallel_sum(torch.stack([values.double().sum(),
                                           torch.tensor(float(values.numel()),
                                                        dtype=torch.float64,
                                                        device=values.device)]))
    return float(stats[0] / stats[1].clamp_min(1))


def data_parallel_mean(metrics: dict) -> dict:
    """Average float metrics over the data-parallel group (same keys on every rank)."""
    if _dp_group() is None:
        return {k: float(v) for k, v in metrics.items()}
    keys = sorted(metrics)
    t = data_parallel_sum(torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64))
    return dict(zip(keys, (t / mpu.get_data_parallel_world_size()).tolist()))


def grouped_means(values, keys, prefix: str = "reward", suffix: str = "mean") -> dict[str, float]:
    """``{f"{prefix}/{key}/{suffix}": mean of the values with that key}`` over every rank's rows
    (``key`` None is left out): e.g. the reward per ``data_source``."""
    sums: dict[str, list[float]] = {}
    for value, key in zip(values, keys):
        if key is not None:
            acc = sums.setdefault(str(key), [0.0, 0.0])
            acc[0] += float(value)
            acc[1] += 1.0
    sums = keyed_sums_over_ranks(sums)
    return {f"{prefix}/{key}/{suffix}": total / count for key, (total, count) in sorted(sums.items())}


def keyed_sums_over_ranks(sums: dict[str, list[float]], group=None, size: int | None = None
                          ) -> dict[str, list[float]]:
    """Element-wise sums of per-key lists of numbers over ranks whose keys may differ (a key a
    rank lacks counts as zeros there). ``size=None``: the data-parallel group; else ``group``
    (None: the default group) of ``size`` ranks."""
    if size is None:
        group = _dp_group()
        size = 1 if group is None else dist.get_world_size(group)
    if size > 1 and dist.is_initialized():
        parts: list = [None] * size
        dist.all_gather_object(parts, sums, group=group)
    else:
        parts = [sums]
    out: dict[str, list[float]] = {}
    for part in parts:
        for key, values in part.items():
            acc = out.setdefault(key, [0.0] * len(values))
            for i, v in enumerate(values):
                acc[i] += v
    return out
