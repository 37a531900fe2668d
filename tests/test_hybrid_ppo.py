"""PPO at PP=2 (2 ranks, the critic and reference at PP=2 too) through the hybrid engine, rollout
TP' 1 and 2: 3 steps give the metrics of the PP=1 run (rel <= 1e-5). TP=2 x PP=2 and DP=2 x
PP=2: tests/test_hybrid_ppo_4ranks.py."""

import pytest

from tests.hybrid_ppo_runs import assert_same_metrics, metrics_at


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return metrics_at(tmp_path_factory.mktemp("ref"), 1, [], "pp1")


@pytest.mark.parametrize("rollout_tp,continuous", [(1, False), (2, False), (1, True)])
def test_pp2_equals_pp1(tmp_path, reference, rollout_tp, continuous):
    """``continuous``: the hybrid engine batches continuously (rollout.kv_budget_tokens) and
    still gives the static PP=1 run's greedy samples."""
    extra = ["rollout.kv_budget_tokens=96", "rollout.max_batch_rows=3"] if continuous else []
    got = metrics_at(tmp_path, 2, ["parallel.pipeline_parallel_size=2",
                                   f"rollout.tensor_parallel_size={rollout_tp}", *extra], "pp2",
                     continuous=continuous)
    assert_same_metrics(got, reference, f"PP=2, rollout TP'={rollout_tp}, continuous={continuous}")
