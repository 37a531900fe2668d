"""PPO at TP=2 x PP=2 (rollout TP' 1 and 2) and DP=2 x PP=2 (TP' 2) on 4 ranks through the hybrid
engine: 3 steps give the metrics of the PP=1, TP=1 run (rel <= 1e-5)."""

import pytest

from tests.helpers.hybrid_ppo_runs import assert_same_metrics, metrics_at_layouts

LAYOUTS = [(2, 1), (2, 2), (1, 2)]  # (tp, rollout_tp)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three 4-rank runs in one world."""
    return metrics_at_layouts(tmp_path_factory.mktemp("four"), 4, {
        (tp, rollout_tp): (["parallel.pipeline_parallel_size=2", f"parallel.tensor_parallel_size={tp}",
                            f"rollout.tensor_parallel_size={rollout_tp}"], False)
        for tp, rollout_tp in LAYOUTS})


@pytest.mark.parametrize("tp,rollout_tp", LAYOUTS)
def test_four_rank_layouts_equal_pp1(runs, hybrid_reference, tp, rollout_tp):
    assert_same_metrics(runs[(tp, rollout_tp)], hybrid_reference,
                        f"TP={tp} x PP=2 (DP={2 // tp}), rollout TP'={rollout_tp}")
