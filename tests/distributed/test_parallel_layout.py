"""Two parallel layouts in the same 2 gloo ranks: the training layout (``init_parallel``) and a
rollout layout of another TP built as a second ``ParallelLayout``. megatron-core's globals stay
the same objects while the rollout layout is built, its model loaded and generating; a rollout
generate between two training forwards changes neither (and vice versa); both models agree with
transformers."""

import pytest
import torch

from parallel_models.testing import run_distributed_jobs
from tests.helpers import parallel_layout_checks

CASES = [(1, 2), (2, 1)]  # (training TP, rollout TP') on 2 ranks


@pytest.fixture(scope="module")
def results(hf_models):
    path = hf_models[("qwen2", "causal_lm")]  # qkv bias, tied embeddings
    jobs = [(parallel_layout_checks.two_layouts, (path, tp, rtp)) for tp, rtp in CASES]
    return dict(zip(CASES, run_distributed_jobs(jobs, 2, timeout=300)))


@pytest.mark.parametrize("tp,rollout_tp", CASES)
def test_two_layouts_interleaved(results, tp, rollout_tp):
    ranks = results[(tp, rollout_tp)]
    for rank, r in enumerate(ranks):
        where = f"rank {rank}, TP={tp} -> TP'={rollout_tp}"
        assert r["changed_by_build"] == [], (where, r["changed_by_build"])
        assert r["changed_by_load"] == [], (where, r["changed_by_load"])
        assert r["changed_during_generate"] == [], (where, r["changed_during_generate"])
        assert r["changed_at_end"] == [], (where, r["changed_at_end"])
        assert r["rollout_group_ok"], where
        assert r["train_same_after_rollout"], where
        assert r["rollout_same_after_train"], where
        assert r["train_vs_hf"] <= 1e-4, (where, r["train_vs_hf"])
        assert r["greedy_vs_hf_mismatches"] == [], (where, r["greedy_vs_hf_mismatches"])
        assert torch.equal(r["responses"], ranks[0]["responses"]), where
    # the shards really differ: the training model's QKV rows are split by TP, the rollout
    # model's by TP'
    actor_rows, rollout_rows = ranks[0]["qkv_rows"]
    assert actor_rows * tp == rollout_rows * rollout_tp and actor_rows != rollout_rows
