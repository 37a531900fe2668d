"""The PPO job with router replay and the mismatch metrics: ``model.path=builtin-moe`` (a tiny
Qwen3-MoE built on the spot) runs GRPO with R3 (+ the reference replaying too, + truncated
importance sampling) and with R2; metrics.jsonl carries the rollout-vs-training metrics every
step (three for the dense built-in Llama, four with ``router/route_mismatch`` for MoE);
R2 / R3 on a dense model is refused with the key named."""

import os

import pytest

from parallel_models.rl.config import ConfigError, load_config
from tests.helpers.ppo_runs import run_metrics, run_ppo

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py

DENSE_KEYS = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/k3_kl")
GRPO = ["algorithm.adv_estimator=grpo", "critic.enable=false", "trainer.save_every=0",
        "trainer.total_steps=2", "trainer.loggers=[jsonl]", "trainer.save_hf_at_end=false"]


@pytest.mark.parametrize("replay,extra", [
    ("R3", ["actor.use_kl_loss=true", "actor.router_replay_reference=true",
            "actor.tis_cap=2.0"]),
    ("R2", []),
])
def test_builtin_moe_grpo_with_router_replay_logs_mismatch(tmp_path, replay, extra):
    out = str(tmp_path / replay)
    run_ppo([f"trainer.output_dir={out}", "model.path=builtin-moe",
             f"actor.router_replay={replay}", *GRPO, *extra])
    assert os.path.isfile(os.path.join(out, "builtin_moe", "config.json"))
    rows = run_metrics(out)
    assert len(rows) == 2
    for row in rows:
        for key in DENSE_KEYS + ("router/route_mismatch",):
            assert key in row and row[key] == row[key], (key, row)  # present, not NaN
        assert 0.0 <= row["router/route_mismatch"] <= 1.0
        # fp32 on the CPU: the rollout's and the training forward's log-probs agree closely
        assert row["rollout/logprob_diff_max"] <= 1e-4, row
        assert row["rollout/logprob_diff_mean"] <= row["rollout/logprob_diff_max"]


def test_dense_run_logs_the_three_logprob_metrics(tmp_path):
    out = str(tmp_path / "dense")
    run_ppo([f"trainer.output_dir={out}", *GRPO, "actor.tis_cap=2.0"])
    for row in run_metrics(out):
        assert all(key in row for key in DENSE_KEYS), row
        assert "router/route_mismatch" not in row
        assert row["rollout/logprob_diff_max"] <= 1e-4 and row["rollout/k3_kl"] >= 0.0


@pytest.mark.parametrize("overrides,message", [
    (["actor.router_replay=R3"], "actor.router_replay=R3: the built-in model"),
    (["actor.router_replay_reference=true"], "actor.router_replay_reference=true needs"),
])
def test_router_replay_on_a_dense_model_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
