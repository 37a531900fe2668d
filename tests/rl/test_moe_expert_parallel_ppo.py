"""PPO of the built-in tiny Qwen3-MoE at expert parallel 2 (2 ranks: experts split over the two
data-parallel ranks, rollout through the hybrid engine) equals the EP=1, DP=2 run (rel <= 1e-5);
so do EP=2 combined with TP=2 and with PP=2 (4 ranks, the load-balancing loss on) against the
same layout at EP=1; and the
config refuses expert-parallel sizes the model or the world cannot take."""

import re

import pytest

from parallel_models.rl.config import ConfigError, load_config
from parallel_models.testing import run_distributed
from tests.helpers import hybrid_checks
from tests.helpers.hybrid_ppo_runs import ABS_FLOOR, REL

# greedy rollouts: which rank generates a prompt cannot change the samples (GAE: greedy groups
# would give GRPO zero advantages)
RUN = ["model.path=builtin-moe", "trainer.total_steps=2", "data.batch_size=4", "rollout.n=2",
       "actor.mini_batch_size=8", "rollout.max_new_tokens=6", "actor.ppo_epochs=1",
       "rollout.greedy=true", "trainer.seed=3", "actor.moe_aux_loss_coef=0.01"]


def _metrics(tmp_path, name, extra, world: int = 2):
    rows = run_distributed(hybrid_checks.ppo_metrics, world, str(tmp_path / name), RUN + extra,
                           timeout=400)[0]
    return [{k: v for k, v in m.items() if not k.startswith(("timing/", "memory/"))}
            for m in rows]


def _assert_same_run(got, want, what):
    assert len(got) == len(want) == 2
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), (step, sorted(set(g) ^ set(w)))
        assert "critic/vf_loss" in w
        for k in w:
            tol = REL * max(abs(w[k]), abs(g[k])) + ABS_FLOOR
            assert abs(g[k] - w[k]) <= tol, f"{what} step {step + 1} {k}: {g[k]} vs {w[k]}"
    assert want[1]["actor/pg_loss"] != want[0]["actor/pg_loss"]


@pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py
def test_ep2_equals_ep1(tmp_path):
    want = _metrics(tmp_path, "ep1", [])
    got = _metrics(tmp_path, "ep2", ["parallel.expert_parallel_size=2"])
    assert "actor/moe_aux_loss" in want[0]
    _assert_same_run(got, want, "EP=2")


@pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py
@pytest.mark.parametrize("layout", [
    ["parallel.tensor_parallel_size=2"],
    # the load-balancing loss (0.01) rides the pipeline messages (llama/layers/moe_aux_carry.py)
    ["parallel.pipeline_parallel_size=2"]],
    ids=["tp2", "pp2"])
def test_ep2_with_tp_or_pp_equals_ep1(tmp_path, layout):
    want = _metrics(tmp_path, "ep1", layout, world=4)
    got = _metrics(tmp_path, "ep2", layout + ["parallel.expert_parallel_size=2"], world=4)
    assert "actor/moe_aux_loss" in want[0]
    _assert_same_run(got, want, f"EP=2 with {layout[0]}")


@pytest.mark.parametrize("overrides,message", [
    (["parallel.expert_parallel_size=2"], "the built-in model (model.path=null) is a dense"),
    (["model.path=builtin-moe", "parallel.expert_parallel_size=3"],
     "does not divide the model's num_experts (4)"),
    (["model.path=builtin-moe", "parallel.expert_parallel_size=2", "parallel.backend=fsdp"],
     "expert parallel runs in the megatron backend"),
])
def test_bad_expert_parallel_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_world_size_must_hold_the_expert_grid(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="expert_parallel_size = 4"):
        load_config(None, ["model.path=builtin-moe", "parallel.expert_parallel_size=4",
                           "data.batch_size=4", "actor.mini_batch_size=4"])
