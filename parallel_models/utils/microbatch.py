"""Split a batch into microbatches and put per-microbatch outputs back in order.

A *batch* is a ``dict[str, torch.Tensor]`` whose tensors all share batch dim 0,
e.g. ``{"input_ids": (B, S), "attention_mask": (B, S), "advantages": (B, S)}``.

* :func:`split_by_count` cuts the batch into ``n`` contiguous pieces whose sizes
  differ by at most one (classic gradient accumulation / pipeline microbatches).
* :func:`split_by_token_budget` is "dynamic batch size": it groups samples so
  that no microbatch holds more than ``max_tokens_per_microbatch`` real tokens,
  using as few microbatches as a balanced greedy partition allows (rounded up
  to a multiple, because pipeline schedules and data-parallel ranks need equal
  counts). It also returns the original indices of every microbatch.
* :func:`restore_order` concatenates per-microbatch outputs and undoes the
  permutation of :func:`split_by_token_budget`.
* :func:`plan_token_budget_partitions` is the tensor-free planner behind
  :func:`split_by_token_budget` (works on lengths only), handy when ranks need
  to agree on a microbatch count before splitting.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = [
    "split_by_count",
    "split_by_token_budget",
    "plan_token_budget_partitions",
    "restore_order",
]


# ----------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------


def _batch_size(batch: Mapping[str, Tensor]) -> int:
    """Validate ``batch`` and return its (shared) size along dim 0."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a dict of tensors, got {type(batch).__name__}")
    if len(batch) == 0:
        raise ValueError("batch is empty (no tensors), cannot infer the batch size")
    size = None
    first_key = None
    for key, value in batch.items():
        if not isinstance(value, Tensor):
            raise TypeError(
                f"batch[{key!r}] must be a torch.Tensor with batch dim 0, got {type(value).__name__}"
            )
        if value.dim() == 0:
            raise ValueError(f"batch[{key!r}] is a 0-d tensor; every tensor needs a batch dim 0")
        if size is None:
            size, first_key = value.size(0), key
        elif value.size(0) != size:
            raise ValueError(
                f"batch tensors disagree on batch size (dim 0): batch[{first_key!r}] has {size}, "
                f"batch[{key!r}] has {value.size(0)} (shape {tuple(value.shape)})"
            )
    assert size is not None
    return size


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _seq_lens_list(batch: Mapping[str, Tensor], seq_lens, batch_size: int) -> list[int]:
    """Per-sample token counts as python ints (from ``seq_lens`` or the attention mask)."""
    if seq_lens is None:
        if "attention_mask" not in batch:
            raise ValueError(
                "seq_lens was not given and batch has no 'attention_mask' to derive it from "
                f"(keys: {sorted(batch)}); pass seq_lens explicitly"
            )
        mask = batch["attention_mask"]
        if mask.dim() != 2:
            raise ValueError(
                f"cannot derive seq_lens from batch['attention_mask'] of shape {tuple(mask.shape)}: "
                "expected a 2-D (batch, seq) padding mask; pass seq_lens explicitly"
            )
        lens = mask.sum(-1)
        source = "attention_mask.sum(-1)"
    else:
        lens = seq_lens if isinstance(seq_lens, Tensor) else torch.as_tensor(seq_lens)
        source = "seq_lens"
        if lens.dim() != 1 or lens.size(0) != batch_size:
            raise ValueError(
                f"seq_lens must have shape ({batch_size},) to match the batch size, "
                f"got shape {tuple(lens.shape)}"
            )
    lens = lens.detach()
    if lens.is_floating_point():
        if not bool(torch.all(lens == lens.round())):
            raise ValueError(f"{source} must hold whole token counts, got non-integral values {lens.tolist()}")
    elif lens.dtype == torch.bool or lens.is_complex():
        raise TypeError(f"{source} must be an integer tensor of token counts, got dtype {lens.dtype}")
    values = [int(v) for v in lens.tolist()]
    for i, v in enumerate(values):
        if v < 0:
            raise ValueError(f"{source}[{i}] is negative ({v}); token counts must be >= 0")
    return values


def _take(batch: Mapping[str, Tensor], idx: list[int]) -> dict[str, Tensor]:
    out = {}
    index_cache: dict[torch.device, Tensor] = {}
    for key, value in batch.items():
        index = index_cache.get(value.device)
        if index is None:
            index = torch.tensor(idx, dtype=torch.long, device=value.device)
            index_cache[value.device] = index
        out[key] = value.index_select(0, index)
    return out


# ----------------------------------------------------------------------------
# splitting
# ----------------------------------------------------------------------------


def split_by_count(batch: dict[str, Tensor], num_microbatches: int) -> list[dict[str, Tensor]]:
    """Split ``batch`` into ``num_microbatches`` contiguous microbatches.

    Sizes differ by at most one; the first ``B % num_microbatches`` microbatches
    get the extra sample. Values are views (slices along dim 0) of the inputs.
    Concatenating the microbatches in order gives back the batch.
    """
    batch_size = _batch_size(batch)
    _check_positive_int("num_microbatches", num_microbatches)
    if num_microbatches > batch_size:
        raise ValueError(
            f"num_microbatches ({num_microbatches}) is larger than the batch size ({batch_size}); "
            "every microbatch needs at least one sample"
        )
    base, extra = divmod(batch_size, num_microbatches)
    out = []
    start = 0
    for i in range(num_microbatches):
        size = base + (1 if i < extra else 0)
        out.append({k: v.narrow(0, start, size) for k, v in batch.items()})
        start += size
    return out


def _lpt_partition(order: list[int], lens: list[int], k: int, budget: int) -> list[list[int]] | None:
    """Longest-processing-time-first into ``k`` bins; ``None`` if a sample does not fit.

    ``order`` lists sample indices by descending length. Each goes into the
    currently lightest bin (ties: fewest samples, then lowest bin id, so empty
    bins are filled first even with zero-length samples). Since the lightest
    bin is the only candidate that could fit, failing there means no bin fits.
    """
    heap = [(0, 0, b) for b in range(k)]  # (tokens, num_samples, bin id)
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        load, count, b = heapq.heappop(heap)
        if load + lens[i] > budget:
            return None
        bins[b].append(i)
        heapq.heappush(heap, (load + lens[i], count + 1, b))
    return bins


def plan_token_budget_partitions(
    seq_lens: Sequence[int] | Tensor,
    max_tokens_per_microbatch: int,
    min_num_microbatches: int = 1,
    num_microbatches_multiple_of: int = 1,
) -> list[list[int]]:
    """Plan microbatches from per-sample lengths alone; see :func:`split_by_token_budget`.

    Returns one list of original sample indices per microbatch (ascending
    within a microbatch; microbatches ordered by their smallest index).
    """
    lens_t = seq_lens if isinstance(seq_lens, Tensor) else torch.as_tensor(list(seq_lens))
    if lens_t.dim() != 1:
        raise ValueError(f"seq_lens must be 1-D (one length per sample), got shape {tuple(lens_t.shape)}")
    lens = _seq_lens_list({"seq_lens": lens_t}, lens_t, lens_t.size(0))
    return _plan(lens, max_tokens_per_microbatch, min_num_microbatches, num_microbatches_multiple_of)


def _plan(lens: list[int], budget: int, min_k: int, multiple: int) -> list[list[int]]:
    _check_positive_int("max_tokens_per_microbatch", budget)
    _check_positive_int("min_num_microbatches", min_k)
    _check_positive_int("num_microbatches_multiple_of", multiple)
    n = len(lens)
    if n == 0:
        raise ValueError("cannot split an empty batch (batch size 0)")
    for i, length in enumerate(lens):
        if length > budget:
            raise ValueError(
                f"sample {i} has {length} tokens, more than max_tokens_per_microbatch={budget}; "
                "raise the budget or truncate/drop the sample"
            )

    def round_up(k: int) -> int:
        return -(-k // multiple) * multiple

    total = sum(lens)
    k = round_up(max(min_k, math.ceil(total / budget), 1))
    if k > n:
        raise ValueError(
            f"need {k} microbatches (min_num_microbatches={min_k}, "
            f"ceil(total tokens {total} / max_tokens_per_microbatch {budget})="
            f"{math.ceil(total / budget)}, rounded up to a multiple of "
            f"num_microbatches_multiple_of={multiple}) but the batch has only {n} samples; "
            "every microbatch needs at least one sample"
        )
    order = sorted(range(n), key=lambda i: (-lens[i], i))
    while k <= n:
        bins = _lpt_partition(order, lens, k, budget)
        if bins is not None:
            bins = [sorted(b) for b in bins]
            bins.sort(key=lambda b: b[0])
            return bins
        k += multiple
    # With k == n every sample gets its own bin and fits, so we only get here when
    # the multiple-of rounding jumps past n.
    raise ValueError(
        f"no partition of {n} samples (total {total} tokens, longest {max(lens)}) into a multiple of "
        f"num_microbatches_multiple_of={multiple} microbatches fits max_tokens_per_microbatch={budget} "
        f"with at most {n} microbatches (every microbatch needs at least one sample)"
    )


def split_by_token_budget(
    batch: dict[str, Tensor],
    max_tokens_per_microbatch: int,
    seq_lens: Tensor | None = None,
    min_num_microbatches: int = 1,
    num_microbatches_multiple_of: int = 1,
) -> tuple[list[dict[str, Tensor]], list[list[int]]]:
    """Split ``batch`` into token-balanced microbatches (dynamic batch size).

    Every microbatch holds at most ``max_tokens_per_microbatch`` tokens, counted
    as the sum of its samples' ``seq_lens`` (default: ``attention_mask.sum(-1)``).
    The number of microbatches ``k`` is the smallest value that is
    ``>= min_num_microbatches``, ``>= ceil(total / budget)``, a multiple of
    ``num_microbatches_multiple_of``, and for which a greedy
    longest-processing-time-first assignment (longest sample first, always into
    the lightest microbatch) fits the budget. The LPT assignment guarantees
    ``max - min`` microbatch tokens ``<= `` the longest sample.

    Within a microbatch, samples keep ascending original order; microbatches are
    ordered by their first (smallest) sample index. Tensors are gathered with
    ``index_select`` (copies). Returns ``(microbatches, indices)`` where
    ``indices[j]`` lists the original sample indices of microbatch ``j``; pass it
    to :func:`restore_order` to put per-microbatch outputs back in batch order.

    Raises ``ValueError`` if a single sample exceeds the budget, or if the
    required count exceeds the batch size (microbatches are never empty).
    """
    batch_size = _batch_size(batch)
    lens = _seq_lens_list(batch, seq_lens, batch_size)
    indices = _plan(lens, max_tokens_per_microbatch, min_num_microbatches, num_microbatches_multiple_of)
    return [_take(batch, idx) for idx in indices], indices


# ----------------------------------------------------------------------------
# restoring order
# ----------------------------------------------------------------------------


def _inverse_permutation(indices: Sequence[Sequence[int]], sizes: list[int]) -> list[int]:
    if len(indices) != len(sizes):
        raise ValueError(
            f"got {len(sizes)} microbatch outputs but {len(indices)} index lists; they must match"
        )
    flat: list[int] = []
    for j, (idx, size) in enumerate(zip(indices, sizes)):
        if len(idx) != size:
            raise ValueError(
                f"microbatch {j}: output has {size} samples along dim 0 but indices[{j}] lists {len(idx)}"
            )
        flat.extend(int(i) for i in idx)
    n = len(flat)
    inverse = [-1] * n
    for pos, i in enumerate(flat):
        if not 0 <= i < n:
            raise ValueError(f"index {i} is out of range for {n} samples in total; indices must be a permutation of 0..{n - 1}")
        if inverse[i] != -1:
            raise ValueError(f"sample index {i} appears more than once in indices; indices must be a permutation of 0..{n - 1}")
        inverse[i] = pos
    return inverse


def _restore_tensors(outputs: Sequence[Tensor], indices, what: str) -> Tensor:
    for j, out in enumerate(outputs):
        if not isinstance(out, Tensor):
            raise TypeError(f"{what}[{j}] must be a torch.Tensor, got {type(out).__name__}")
        if out.dim() == 0:
            raise ValueError(f"{what}[{j}] is a 0-d tensor; outputs need a sample dim 0")
    inverse = _inverse_permutation(indices, [o.size(0) for o in outputs])
    cat = torch.cat(list(outputs), dim=0)
    return cat.index_select(0, torch.tensor(inverse, dtype=torch.long, device=cat.device))


def restore_order(
    outputs: Sequence[Tensor] | Sequence[Mapping[str, Tensor]],
    indices: Sequence[Sequence[int]],
) -> Tensor | dict[str, Tensor]:
    """Concatenate per-microbatch ``outputs`` (dim 0 = samples) in original batch order.

    ``indices[j]`` lists the original sample index of each row of ``outputs[j]``
    (as returned by :func:`split_by_token_budget`); together they must form a
    permutation of ``0..N-1``. ``outputs`` may be a list of tensors (returns a
    tensor) or a list of dicts of tensors with the same keys (returns a dict).
    Differentiable (``cat`` + ``index_select``).
    """
    if len(outputs) == 0:
        raise ValueError("outputs is empty; need at least one microbatch output")
    if all(isinstance(o, Mapping) for o in outputs):
        keys = list(outputs[0].keys())
        for j, o in enumerate(outputs):
            if set(o.keys()) != set(keys):
                raise ValueError(
                    f"outputs[{j}] has keys {sorted(o.keys())} but outputs[0] has {sorted(keys)}; "
                    "all microbatch outputs must have the same keys"
                )
        return {k: _restore_tensors([o[k] for o in outputs], indices, f"outputs[*][{k!r}]") for k in keys}
    if any(isinstance(o, Mapping) for o in outputs):
        raise TypeError("outputs mixes dicts and tensors; pass all tensors or all dicts of tensors")
    return _restore_tensors(outputs, indices, "outputs")
