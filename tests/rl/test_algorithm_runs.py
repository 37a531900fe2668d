"""Every advantage estimator, policy loss and loss aggregation runs 2 steps of the built-in job on
the CPU (each run pairs one estimator with one loss and one aggregation, so every name appears
in a run), and GSPO raises the built-in job's reward as GRPO does (the math itself:
tests/rl/test_algorithms_vs_verl.py)."""

import math

import pytest

from parallel_models.rl.algorithms import estimators, losses
from tests.helpers.ppo_runs import run_metrics, run_ppo

TINY = ["trainer.total_steps=2", "trainer.save_every=0", "trainer.loggers=[jsonl]",
        "data.batch_size=4", "rollout.max_new_tokens=8", "actor.ppo_epochs=1"]

# (estimator, policy loss, aggregation, extra settings)
RUNS = [
    ("gae", "vanilla", "token-mean", []),
    ("grpo", "gspo", "seq-mean-token-mean", []),
    ("grpo", "ppo", "seq-mean-token-sum-norm",  # Dr. GRPO
     ["algorithm.norm_adv_by_std=false", "actor.loss_scale_factor=8"]),
    ("rloo", "geo_mean", "seq-mean-token-mean", []),
    ("reinforce_plus_plus", "cispo", "token-sum", []),
    ("reinforce_plus_plus_baseline", "clip_cov", "token-mean", ["actor.clip_cov_lb=0"]),
    ("remax", "kl_cov", "seq-mean-token-sum", ["actor.kl_cov_ratio=0.1"]),
    ("opo", "vanilla", "seq-mean-token-mean", []),
    ("gpg", "gpg", "token-mean", []),
]


def test_the_runs_cover_every_name():
    names = {r[0] for r in RUNS}, {r[1] for r in RUNS}, {r[2] for r in RUNS}
    assert names[0] == set(estimators.ADVANTAGE_ESTIMATORS.names())
    assert names[1] == set(losses.POLICY_LOSSES.names())
    assert names[2] == set(losses.LOSS_AGG_MODES)


@pytest.mark.parametrize("estimator,loss,mode,extra", RUNS, ids=[f"{r[0]}-{r[1]}" for r in RUNS])
def test_two_steps_of_the_builtin_job(tmp_path, estimator, loss, mode, extra):
    out = str(tmp_path / "run")
    critic = "true" if estimator == "gae" else "false"
    run_ppo([f"trainer.output_dir={out}", *TINY, f"algorithm.adv_estimator={estimator}",
             f"critic.enable={critic}", f"actor.policy_loss={loss}",
             f"actor.loss_agg_mode={mode}", *extra])
    rows = run_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    declared = losses.POLICY_LOSSES.attribute(losses.POLICY_LOSSES.get(loss), "metrics")
    for r in rows:
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm",
                    *(f"actor/{m}" for m in declared)):
            assert key in r and math.isfinite(r[key]), (key, r)
        assert ("critic/vf_loss" in r) == (estimator == "gae")
        assert ("reward/greedy_baseline_mean" in r) == (estimator == "remax")
    if loss == "clip_cov":  # its knobs here detach some tokens
        assert any(r["actor/pg_clipfrac"] > 0 for r in rows)


def _grpo_run(loss):
    return ["trainer.total_steps=14", "trainer.save_every=0", "trainer.loggers=[jsonl]",
            "algorithm.adv_estimator=grpo", "critic.enable=false", f"actor.policy_loss={loss}"]


@pytest.mark.parametrize("loss", [pytest.param(loss, marks=pytest.mark.early_run(_grpo_run(loss)))
                                  for loss in ("vanilla", "gspo")])  # runs: early_runs.py
def test_grpo_and_gspo_raise_the_builtin_jobs_reward(early_run, loss):
    """The default job's 14 seeded steps (as tests/rl/test_ppo.py's) with GRPO advantages, with
    the clipped PPO loss and with GSPO: the mean reward of the last 3 steps exceeds that of the
    first 3 by more than 0.1 with both. Measured: GRPO 0.045 -> 0.368, GSPO 0.044 -> 0.375."""
    rewards = [r["reward/mean"] for r in run_metrics(early_run)]
    assert len(rewards) == 14
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, f"{loss}: reward did not rise: {rewards}"


@pytest.mark.parametrize("override,words", [
    ("actor.clip_cov_lb=6", "actor.clip_cov_lb (6.0) must be below actor.clip_cov_ub (5.0)"),
    ("actor.loss_agg_mode=token-summ", "seq-mean-token-sum-norm"),
    ("actor.policy_loss=gpsO", "unknown policy loss 'gpsO'"),
])
def test_bad_algorithm_settings_name_the_key(override, words):
    from parallel_models.errors import ConfigError
    from parallel_models.rl.config import load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert words in str(err.value) and override.split("=")[0].split(".")[-1] in str(err.value)


def test_old_configs_name_the_clipped_loss_ppo():
    from parallel_models.rl.config import load_config

    assert load_config(None, []).actor.policy_loss == "vanilla"
    assert losses.POLICY_LOSSES.get("ppo") is losses.POLICY_LOSSES.get("vanilla")
    assert load_config(None, ["actor.policy_loss=ppo"]).actor.policy_loss == "ppo"
