"""The RL workflow end to end (subprocess runs of parallel-models-ppo, the built-in tiny model):
rewards from the dataset's answers (math and exact match, a custom function that reads extra
columns), validation with logged samples, keep-last-K checkpoints, and the built-in verifiable
task whose held-out accuracy rises."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.ppo_runs import read_jsonl as _jsonl
from tests.helpers.ppo_runs import run_ppo as _run
SMALL = ["algorithm.adv_estimator=grpo", "critic.enable=false", "data.batch_size=4",
         "rollout.n=2", "actor.mini_batch_size=8", "rollout.max_new_tokens=6",
         "actor.ppo_epochs=1", "trainer.save_hf_at_end=false", "trainer.loggers=[jsonl]"]


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def test_answers_reach_math_and_exact_match_rewards_with_validation(tmp_path):
    rows = [{"prompt": f"what is {a}+{b}?", "answer": f"#### {a + b}", "data_source": "add"}
            for a in range(4) for b in range(2)]
    data = _write_jsonl(tmp_path / "train.jsonl", rows)
    for fn in ("math_reward", "exact_match"):
        out = str(tmp_path / fn)
        _run(SMALL + [f"trainer.output_dir={out}", "trainer.total_steps=2", "trainer.save_every=0",
                      f"data.path={data}", f"data.val_path={data}", "trainer.test_freq=2",
                      "trainer.val_samples_logged=3",
                      f"reward.function=parallel_models.rl.rewards.rules.{fn}"])
        metrics = _jsonl(os.path.join(out, "metrics.jsonl"))
        assert [m["step"] for m in metrics] == [0, 1, 2]  # validation before training, 2 steps
        assert "val/accuracy" in metrics[0] and "val/add/accuracy" in metrics[2]
        assert all("reward/add/mean" in m for m in metrics[1:])
        samples = _jsonl(os.path.join(out, "samples.jsonl"))
        assert [s["step"] for s in samples] == [0] * 3 + [2] * 3
        assert samples[0]["prompt"] == "what is 0+0?" and samples[0]["ground_truth"] == "#### 0"
        assert os.path.isfile(os.path.join(out, "reward_curve.png"))
        from parallel_models.rl.config import load_config

        saved = load_config(os.path.join(out, "config.yaml"))
        assert saved.reward.function == f"parallel_models.rl.rewards.rules.{fn}"
        assert saved.data.val_path == data


def test_extra_columns_reach_a_custom_reward_and_last_k_checkpoints_are_kept(tmp_path):
    seen = tmp_path / "seen.jsonl"
    reward = tmp_path / "my_reward.py"
    reward.write_text(
        "import json\n"
        "def score(prompts, responses, difficulty, data_source, **kw):\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        f.write(json.dumps({'difficulty': difficulty, 'src': data_source}) + '\\n')\n"
        "    return [float(d) for d in difficulty]\n")
    rows = [{"prompt": f"p{i}", "difficulty": i % 3, "data_source": "s"} for i in range(8)]
    data = _write_jsonl(tmp_path / "d.jsonl", rows)
    out = str(tmp_path / "run")
    _run(SMALL + [f"trainer.output_dir={out}", "trainer.total_steps=3", "trainer.save_every=1",
                  "trainer.max_checkpoints=2", f"data.path={data}", f"reward.function={reward}:score"])
    calls = _jsonl(seen)
    assert len(calls) == 3 and all(len(c["difficulty"]) == 8 for c in calls)  # 4 prompts x n=2
    assert {d for c in calls for d in c["difficulty"]} <= {0, 1, 2}
    assert all(c["src"] == ["s"] * 8 for c in calls)
    metrics = _jsonl(os.path.join(out, "metrics.jsonl"))
    assert all(m["reward/mean"] == m["reward/s/mean"] for m in metrics)
    ckpts = sorted(d for d in os.listdir(os.path.join(out, "checkpoints")) if d.startswith("step_"))
    assert ckpts == ["step_000002", "step_000003"]


HELDOUT_RUN = ["algorithm.adv_estimator=grpo", "data.task=find_digit", "critic.enable=false",
               "algorithm.kl_in_reward=false", "trainer.test_freq=25", "trainer.total_steps=100",
               "trainer.save_every=0", "rollout.n=16", "rollout.max_new_tokens=2",
               "data.batch_size=8", "actor.mini_batch_size=128", "actor.lr=3e-3",
               "actor.ppo_epochs=1", "trainer.loggers=[jsonl]", "trainer.save_hf_at_end=false"]


@pytest.mark.early_run(HELDOUT_RUN)  # on the cores earlier tests leave idle: see early_runs.py
def test_builtin_task_heldout_accuracy_rises(early_run):
    """GRPO on the built-in find_digit task from a random tiny model: greedy accuracy on the
    held-out prompts, first evaluation (before training) vs last. GRPO as verl runs it, without
    a KL term in the reward (a 0.001 x KL in the reward makes every all-wrong group's
    std-normalized advantages pure noise: 0.0 -> 0.21 with it, at twice the samples per step).
    Measured on 2 cores, trainer.seed 0-3: 0.0 -> 0.22, 0.46, 0.44 (0.08 before training),
    0.45 after 100 steps (chance for a uniform digit is 0.1; a policy collapsed onto one digit
    scores ~0.09)."""
    acc = [m["val/accuracy"] for m in _jsonl(os.path.join(early_run, "metrics.jsonl"))
           if "val/accuracy" in m]
    assert len(acc) == 5
    assert acc[-1] > acc[0] and acc[-1] > 0.1, acc
