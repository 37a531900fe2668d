"""PPO at PP=2 (2 ranks, the critic and reference at PP=2 too) through the hybrid engine, rollout
TP' 1 and 2: 3 steps give the metrics of the PP=1 run (rel <= 1e-5). TP=2 x PP=2 and DP=2 x
PP=2: tests/rl/test_hybrid_ppo_4ranks.py."""

import pytest

from tests.helpers.hybrid_ppo_runs import assert_same_metrics, metrics_at_layouts

LAYOUTS = [(1, False), (2, False), (1, True)]  # (rollout_tp, continuous)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three PP=2 runs in one 2-rank world."""
    return metrics_at_layouts(tmp_path_factory.mktemp("pp2"), 2, {
        (rollout_tp, continuous): (
            ["parallel.pipeline_parallel_size=2", f"rollout.tensor_parallel_size={rollout_tp}",
             *(["rollout.kv_budget_tokens=96", "rollout.max_batch_rows=3"] if continuous else [])],
            continuous)
        for rollout_tp, continuous in LAYOUTS})


@pytest.mark.parametrize("rollout_tp,continuous", LAYOUTS)
def test_pp2_equals_pp1(runs, hybrid_reference, rollout_tp, continuous):
    """``continuous``: the hybrid engine batches continuously (rollout.kv_budget_tokens) and
    still gives the static PP=1 run's greedy samples."""
    assert_same_metrics(runs[(rollout_tp, continuous)], hybrid_reference,
                        f"PP=2, rollout TP'={rollout_tp}, continuous={continuous}")
