"""Two parallel layouts in the same 2 gloo ranks: the training layout (``init_parallel``) and a
rollout layout of another TP built as a second ``ParallelLayout``. megatron-core's globals stay
the same objects while the rollout layout is built, its model loaded and generating; a rollout
generate between two training forwards changes neither (and vice versa); both models agree with
transformers. The MoE case runs megatron-core's MoE layer on the rollout layout's groups
(``pg_collection``) beside an expert-parallel training layout."""

import pytest
import torch

from parallel_models.testing import run_distributed_jobs, save_tiny_hf_model
from tests.helpers import parallel_layout_checks

# (family, training TP, training EP, rollout TP') on 2 ranks
CASES = [("qwen2", 1, 1, 2), ("qwen2", 2, 1, 1), ("qwen3_moe", 1, 2, 2)]


@pytest.fixture(scope="module")
def results(hf_models, tmp_path_factory):
    paths = {"qwen2": hf_models[("qwen2", "causal_lm")],  # qkv bias, tied embeddings
             "qwen3_moe": save_tiny_hf_model(str(tmp_path_factory.mktemp("moe") / "m"),
                                             "qwen3_moe", seed=1, router_scale=25.0)}
    jobs = [(parallel_layout_checks.two_layouts, (paths[fam], tp, rtp, ep))
            for fam, tp, ep, rtp in CASES]
    jobs.append((parallel_layout_checks.bad_rollout_sizes, ()))
    return dict(zip(CASES + ["bad"], run_distributed_jobs(jobs, 2, timeout=400)))


def test_bad_rollout_size_is_named(results):
    for messages in results["bad"]:
        assert len(messages) == 2, messages
        assert all("rollout.tensor_parallel_size" in m and "world size (2)" in m
                   for m in messages), messages


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-tp{c[1]}-ep{c[2]}-to-tp{c[3]}")
def test_two_layouts_interleaved(results, case):
    _, tp, _, rollout_tp = case
    ranks = results[case]
    for rank, r in enumerate(ranks):
        where = f"rank {rank}, {case}"
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
