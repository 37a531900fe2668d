"""PPO at PP=2 (2 ranks, the critic and reference at PP=2 too) through the hybrid engine, rollout
TP' 1 and 2: 3 steps give the metrics of the PP=1 run (rel <= 1e-5). TP=2 x PP=2 and DP=2 x
PP=2: tests/test_hybrid_ppo_4ranks.py."""

import pytest

from tests.hybrid_ppo_runs import assert_same_metrics, metrics_at


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return metrics_at(tmp_path_factory.mktemp("ref"), 1, [], "pp1")


@pytest.mark.parametrize("rollout_tp", [1, 2])
def test_pp2_equals_pp1(tmp_path, reference, rollout_tp):
    got = metrics_at(tmp_path, 2, ["parallel.pipeline_parallel_size=2",
                                   f"rollout.tensor_parallel_size={rollout_tp}"], "pp2")
    assert_same_metrics(got, reference, f"PP=2, rollout TP'={rollout_tp}")
