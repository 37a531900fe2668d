"""Tests for parallel_models.utils.microbatch (CPU only, fast)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from parallel_models.utils.microbatch import (
    plan_token_budget_partitions,
    restore_order,
    split_by_count,
    split_by_token_budget,
)


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------


def make_batch(lens: list[int], seq: int | None = None, left_pad: bool = False, mask_dtype=torch.long):
    """A batch whose every tensor encodes the sample index, so we can track samples."""
    b = len(lens)
    seq = seq if seq is not None else max(max(lens), 1)
    mask = torch.zeros(b, seq, dtype=mask_dtype)
    for i, n in enumerate(lens):
        if left_pad:
            mask[i, seq - n :] = 1
        else:
            mask[i, :n] = 1
    ids = torch.arange(b).unsqueeze(1) * 1000 + torch.arange(seq).unsqueeze(0)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "sample_id": torch.arange(b),
        "values": torch.arange(b, dtype=torch.float32).view(b, 1, 1).expand(b, 2, 3).clone(),
    }


def reference_lpt_fits(lens: list[int], k: int, budget: int) -> bool:
    """Independent (slow, list-based) LPT: longest first into the lightest bin."""
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    loads = [0] * k
    counts = [0] * k
    for i in order:
        b = min(range(k), key=lambda j: (loads[j], counts[j], j))
        if loads[b] + lens[i] > budget:
            return False
        loads[b] += lens[i]
        counts[b] += 1
    return True


def check_partition(lens, budget, indices, min_k=1, multiple=1):
    n = len(lens)
    flat = [i for mb in indices for i in mb]
    assert sorted(flat) == list(range(n)), "every sample exactly once"
    assert all(len(mb) > 0 for mb in indices), "no empty microbatch"
    for mb in indices:
        assert mb == sorted(mb), "ascending original order inside a microbatch"
    loads = [sum(lens[i] for i in mb) for mb in indices]
    assert max(loads) <= budget, (loads, budget)
    assert max(loads) - min(loads) <= max(lens), ("unbalanced", loads, max(lens))
    k = len(indices)
    assert k >= min_k
    assert k % multiple == 0
    assert k >= math.ceil(sum(lens) / budget)
    # minimality: no smaller admissible count would have fitted with the greedy
    lower = max(min_k, math.ceil(sum(lens) / budget), 1)
    for smaller in range(lower, k):
        if smaller % multiple == 0:
            assert not reference_lpt_fits(lens, smaller, budget), (
                f"k={k} returned but greedy already fits with {smaller}"
            )
    # and the returned count does fit with the reference greedy
    assert reference_lpt_fits(lens, k, budget)


# ----------------------------------------------------------------------------
# split_by_count
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("b", [1, 2, 5, 7, 16])
def test_split_by_count_covers_all_in_order(b):
    batch = make_batch([3] * b)
    for n in range(1, b + 1):
        mbs = split_by_count(batch, n)
        assert len(mbs) == n
        sizes = [mb["sample_id"].numel() for mb in mbs]
        assert max(sizes) - min(sizes) <= 1
        assert sum(sizes) == b
        got = torch.cat([mb["sample_id"] for mb in mbs])
        assert got.tolist() == list(range(b))
        for key in batch:
            torch.testing.assert_close(torch.cat([mb[key] for mb in mbs]), batch[key])
        # restore_order with contiguous indices is the identity
        idx, start = [], 0
        for s in sizes:
            idx.append(list(range(start, start + s)))
            start += s
        torch.testing.assert_close(restore_order([mb["values"] for mb in mbs], idx), batch["values"])


def test_split_by_count_errors():
    batch = make_batch([2, 2, 2])
    with pytest.raises(ValueError, match=r"num_microbatches \(4\).*batch size \(3\)"):
        split_by_count(batch, 4)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1, got 0"):
        split_by_count(batch, 0)
    with pytest.raises(ValueError, match="disagree on batch size"):
        split_by_count({"a": torch.zeros(3, 2), "b": torch.zeros(4, 2)}, 1)
    with pytest.raises(ValueError, match="empty"):
        split_by_count({}, 1)


# ----------------------------------------------------------------------------
# split_by_token_budget
# ----------------------------------------------------------------------------


def test_token_budget_simple_example():
    lens = [5, 1, 4, 2, 3]
    batch = make_batch(lens)
    mbs, idx = split_by_token_budget(batch, max_tokens_per_microbatch=8)
    # total 15 -> at least 2 microbatches; LPT: 5->A, 4->B, 3->B(7), 2->A(7), 1->A(8)
    assert idx == [[0, 1, 3], [2, 4]]
    assert [mb["sample_id"].tolist() for mb in mbs] == idx
    assert [int(mb["attention_mask"].sum()) for mb in mbs] == [8, 7]


def test_token_budget_single_microbatch_when_it_fits():
    lens = [3, 1, 2]
    mbs, idx = split_by_token_budget(make_batch(lens), max_tokens_per_microbatch=6)
    assert idx == [[0, 1, 2]]
    assert mbs[0]["sample_id"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("n,length,budget", [(10, 3, 7), (9, 4, 100), (17, 5, 5), (12, 2, 9)])
def test_token_budget_uniform_lengths_count_is_exact(n, length, budget):
    # equal lengths: c = budget // length samples fit per microbatch -> ceil(n / c) microbatches
    lens = [length] * n
    _, idx = split_by_token_budget(make_batch(lens), budget)
    per = budget // length
    assert len(idx) == math.ceil(n / per)
    check_partition(lens, budget, idx)


def test_token_budget_random_shapes():
    rng = random.Random(1234)
    for trial in range(300):
        n = rng.randint(1, 40)
        max_len = rng.randint(1, 64)
        lens = [rng.randint(0 if trial % 7 == 0 else 1, max_len) for _ in range(n)]
        if max(lens) == 0:
            lens[0] = 1
        budget = rng.randint(max(lens), max(lens) * 4 + 3)
        multiple = rng.choice([1, 1, 2, 3, 4])
        min_k = rng.choice([1, 1, 2, 3, 5])
        batch = make_batch(lens, seq=max_len + rng.randint(0, 3), left_pad=bool(trial % 2))
        need = max(min_k, math.ceil(sum(lens) / budget), 1)
        need = -(-need // multiple) * multiple
        if need > n:
            with pytest.raises(ValueError, match="at least one sample"):
                split_by_token_budget(batch, budget, min_num_microbatches=min_k,
                                      num_microbatches_multiple_of=multiple)
            continue
        try:
            mbs, idx = split_by_token_budget(batch, budget, min_num_microbatches=min_k,
                                             num_microbatches_multiple_of=multiple)
        except ValueError as e:
            # only legal when the multiple-of rounding jumps past n before the greedy fits
            assert "num_microbatches_multiple_of" in str(e)
            assert all(not reference_lpt_fits(lens, k, budget)
                       for k in range(need, n + 1, multiple))
            continue
        check_partition(lens, budget, idx, min_k=min_k, multiple=multiple)
        # microbatch contents match the indices, tensors carried along faithfully
        for mb, ids in zip(mbs, idx):
            assert mb["sample_id"].tolist() == ids
            torch.testing.assert_close(mb["input_ids"], batch["input_ids"][ids])
            torch.testing.assert_close(mb["values"], batch["values"][ids])
            assert mb["attention_mask"].sum().item() <= budget
        # per-sample outputs that are a function of the sample come back in input order
        outs = [mb["input_ids"].float().sum(-1) * 2 + mb["attention_mask"].sum(-1) for mb in mbs]
        expected = batch["input_ids"].float().sum(-1) * 2 + batch["attention_mask"].sum(-1)
        torch.testing.assert_close(restore_order(outs, idx), expected)
        # dict outputs
        restored = restore_order([{"id": mb["sample_id"], "v": mb["values"]} for mb in mbs], idx)
        assert restored["id"].tolist() == list(range(n))
        torch.testing.assert_close(restored["v"], batch["values"])


def test_token_budget_explicit_seq_lens_override_mask():
    batch = make_batch([1, 1, 1, 1])
    seq_lens = torch.tensor([10, 1, 10, 1])
    _, idx = split_by_token_budget(batch, 11, seq_lens=seq_lens)
    check_partition(seq_lens.tolist(), 11, idx)
    assert len(idx) == 2
    # the mask alone would have put everything into one microbatch
    _, idx_mask = split_by_token_budget(batch, 11)
    assert idx_mask == [[0, 1, 2, 3]]


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.float32])
def test_token_budget_mask_dtypes(dtype):
    lens = [4, 3, 2, 1]
    _, idx = split_by_token_budget(make_batch(lens, mask_dtype=dtype), 5)
    check_partition(lens, 5, idx)
    assert len(idx) == 2


def test_token_budget_multiple_of():
    lens = [3, 3, 3, 3, 3, 3]
    _, idx = split_by_token_budget(make_batch(lens), 9)  # 2 microbatches suffice
    assert len(idx) == 2
    _, idx = split_by_token_budget(make_batch(lens), 9, num_microbatches_multiple_of=3)
    assert len(idx) == 3
    check_partition(lens, 9, idx, multiple=3)
    _, idx = split_by_token_budget(make_batch(lens), 9, num_microbatches_multiple_of=4)
    assert len(idx) == 4
    check_partition(lens, 9, idx, multiple=4)


def test_token_budget_min_count():
    lens = [1, 2, 3, 4, 5]
    _, idx = split_by_token_budget(make_batch(lens), 100)
    assert len(idx) == 1
    _, idx = split_by_token_budget(make_batch(lens), 100, min_num_microbatches=3)
    assert len(idx) == 3
    check_partition(lens, 100, idx, min_k=3)
    _, idx = split_by_token_budget(make_batch(lens), 100, min_num_microbatches=3,
                                   num_microbatches_multiple_of=2)
    assert len(idx) == 4
    with pytest.raises(ValueError, match=r"min_num_microbatches=6.*only 5 samples"):
        split_by_token_budget(make_batch(lens), 100, min_num_microbatches=6)
    with pytest.raises(ValueError, match=r"num_microbatches_multiple_of=4.*only 5 samples"):
        split_by_token_budget(make_batch(lens), 100, min_num_microbatches=5,
                              num_microbatches_multiple_of=4)


def test_token_budget_over_long_sample_error():
    lens = [3, 9, 2]
    with pytest.raises(ValueError, match=r"sample 1 has 9 tokens.*max_tokens_per_microbatch=8"):
        split_by_token_budget(make_batch(lens), 8)
    with pytest.raises(ValueError, match=r"sample 2 has 12 tokens.*max_tokens_per_microbatch=10"):
        split_by_token_budget(make_batch([1, 1, 1]), 10, seq_lens=torch.tensor([1, 1, 12]))


def test_token_budget_argument_errors():
    batch = make_batch([2, 2])
    with pytest.raises(ValueError, match="max_tokens_per_microbatch must be >= 1, got 0"):
        split_by_token_budget(batch, 0)
    with pytest.raises(ValueError, match="num_microbatches_multiple_of must be >= 1, got 0"):
        split_by_token_budget(batch, 4, num_microbatches_multiple_of=0)
    with pytest.raises(ValueError, match="min_num_microbatches must be >= 1, got 0"):
        split_by_token_budget(batch, 4, min_num_microbatches=0)
    with pytest.raises(ValueError, match=r"seq_lens must have shape \(2,\)"):
        split_by_token_budget(batch, 4, seq_lens=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="attention_mask"):
        split_by_token_budget({"input_ids": torch.zeros(2, 3)}, 4)
    with pytest.raises(ValueError, match="negative"):
        split_by_token_budget(batch, 4, seq_lens=torch.tensor([1, -1]))


def test_plan_matches_split():
    rng = random.Random(7)
    for _ in range(50):
        lens = [rng.randint(1, 30) for _ in range(rng.randint(1, 25))]
        budget = rng.randint(30, 90)
        _, idx = split_by_token_budget(make_batch(lens), budget)
        assert plan_token_budget_partitions(lens, budget) == idx
        assert plan_token_budget_partitions(torch.tensor(lens), budget) == idx


# ----------------------------------------------------------------------------
# restore_order
# ----------------------------------------------------------------------------


def test_restore_order_permutation_and_grad():
    x = torch.randn(7, 3, requires_grad=True)
    indices = [[4, 0], [6, 1, 2], [3, 5]]
    outs = [x[idx] * 2 for idx in indices]
    y = restore_order(outs, indices)
    torch.testing.assert_close(y, x * 2)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_restore_order_errors():
    a, b = torch.zeros(2, 1), torch.zeros(1, 1)
    with pytest.raises(ValueError, match="2 microbatch outputs but 1 index lists"):
        restore_order([a, b], [[0, 1]])
    with pytest.raises(ValueError, match=r"microbatch 1: output has 1 samples.*lists 2"):
        restore_order([a, b], [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="more than once"):
        restore_order([a, b], [[0, 1], [1]])
    with pytest.raises(ValueError, match="out of range"):
        restore_order([a, b], [[0, 1], [5]])
    with pytest.raises(ValueError, match="same keys"):
        restore_order([{"x": a}, {"y": b}], [[0, 1], [2]])
    with pytest.raises(ValueError, match="empty"):
        restore_order([], [])
