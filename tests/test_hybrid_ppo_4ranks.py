"""PPO at TP=2 x PP=2 (rollout TP' 1 and 2) and DP=2 x PP=2 (TP' 2) on 4 ranks through the hybrid
engine: 3 steps give the metrics of the PP=1, TP=1 run (rel <= 1e-5)."""

import pytest

from tests.hybrid_ppo_runs import assert_same_metrics, metrics_at


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return metrics_at(tmp_path_factory.mktemp("ref"), 1, [], "pp1")


@pytest.mark.parametrize("tp,rollout_tp", [(2, 1), (2, 2), (1, 2)])
def test_four_rank_layouts_equal_pp1(tmp_path, reference, tp, rollout_tp):
    got = metrics_at(tmp_path, 4, ["parallel.pipeline_parallel_size=2",
                                   f"parallel.tensor_parallel_size={tp}",
                                   f"rollout.tensor_parallel_size={rollout_tp}"], "run")
    assert_same_metrics(got, reference, f"TP={tp} x PP=2 (DP={2 // tp}), rollout TP'={rollout_tp}")
