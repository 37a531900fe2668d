"""The built-in MoE PPO job on 2 ranks: R3 at DP=2 (each rank replays its own rollout's routes)
and R2 at TP=2 (MoE at TP>1 runs sequence parallel: each rank routes half the tokens; the
recorded routes are gathered over the TP group); the mismatch metrics are there every step and
the training forward reproduces the rollout's log-probs (fp32, CPU)."""

import pytest

from parallel_models.testing import run_distributed
from tests.helpers import hybrid_checks

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py

RUN = ["model.path=builtin-moe", "algorithm.adv_estimator=grpo", "critic.enable=false",
       "trainer.total_steps=2", "data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=8",
       "rollout.max_new_tokens=6", "actor.ppo_epochs=1"]


@pytest.mark.parametrize("layout", [["actor.router_replay=R3"],
                                    ["actor.router_replay=R2", "parallel.tensor_parallel_size=2"]])
def test_builtin_moe_replay_on_two_ranks(tmp_path, layout):
    ranks = run_distributed(hybrid_checks.ppo_metrics, 2, str(tmp_path / "run"), RUN + layout,
                            timeout=400)
    for rows in ranks:
        assert len(rows) == 2
        for row in rows:
            assert row["router/route_mismatch"] == 0.0, row  # wide margins: no near ties here
            assert row["rollout/logprob_diff_max"] <= 1e-5, row
            assert row["rollout/k3_kl"] <= 1e-8, row
    keys = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/k3_kl",
            "router/route_mismatch", "reward/mean")
    for mine, other in zip(*ranks):  # global over the ranks
        assert [mine[k] for k in keys] == [other[k] for k in keys]
