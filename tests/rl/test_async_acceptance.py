"""Issue 35's CPU acceptance: ``parallel-models-ppo trainer.mode=async rollout.max_staleness=1``
(the trainer starting its own rollout server process) raises the built-in job's reward as the
sync job does (tests/rl/test_ppo.py's bar, same 14 steps), with ``async/staleness_max`` <= 1 at
every logged step."""

import os

import pytest

from tests.helpers.ppo_runs import run_metrics, run_ppo

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py


def test_async_default_job_raises_reward(tmp_path):
    out = str(tmp_path / "run")
    run_ppo([f"trainer.output_dir={out}", "trainer.total_steps=14", "trainer.save_every=0",
             "trainer.mode=async", "rollout.max_staleness=1", "trainer.loggers=[jsonl]",
             "trainer.save_hf_at_end=false"], timeout=600)
    rows = run_metrics(out)
    rewards = [m["reward/mean"] for m in rows]
    assert len(rewards) == 14
    assert all(m["async/staleness_max"] <= 1 for m in rows), [m["async/staleness_max"]
                                                               for m in rows]
    assert max(m["async/staleness_max"] for m in rows) == 1  # the rollout ran ahead
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, f"reward did not rise: {rewards}"
    assert os.path.getsize(os.path.join(out, "rollout_server.log")) >= 0  # the run's own server
