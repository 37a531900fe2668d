"""DAPO: dynamic sampling (``rl/data/dynamic_sampling.py``), overlong shaping
(``rl/rewards/overlong.py``) and the example ``examples/dapo.yaml``: groups with one reward for all
samples are dropped and the batch filled from more prompt batches, the same at DP=1 and DP=2; an
all-constant run stops naming the setting; kill -9 + resume is exact; the overlong penalty is
verl's; the example runs and raises the built-in job's reward."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from parallel_models.rl.data.batch import RolloutBatch
from parallel_models.rl.data.dynamic_sampling import collect_groups
from parallel_models.rl.rewards.overlong import overlong_penalty
from parallel_models.testing import run_distributed
from tests.helpers.ppo_runs import resume_after_kill_matches, run_metrics, run_ppo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 2  # samples per prompt
PROMPTS = 4  # prompts per drawn batch (= data.batch_size)


def _constant(round_index: int, index: int) -> bool:
    return round_index == 0 and index != 3  # round 0 keeps 1 group, round 1 all 4


def _fake_draw(rank: int, size: int, calls: list, constant=_constant):
    """A rank's share of prompt batch ``round``: group (round, index) is tokens
    [round, index] + a response; its rewards agree when ``constant(round, index)``."""
    def draw(round_index):
        calls.append(round_index)
        mine = [i for i in range(PROMPTS) if i % size == rank]
        rows = len(mine) * N
        seq = torch.tensor([[round_index, i, 5 + s] for i in mine for s in range(N)])
        scores = torch.tensor([0.5 if constant(round_index, i) else float(s)
                               for i in mine for s in range(N)])
        batch = RolloutBatch(sequences=seq, attention_mask=torch.ones_like(seq),
                             prompt_lengths=torch.full((rows,), 2),
                             response_mask=torch.ones(rows, 1, dtype=torch.long),
                             group_index=torch.arange(len(mine)).repeat_interleave(N),
                             scores=scores)
        return batch, mine
    return draw


def _collect(batch_size=PROMPTS, max_gen_batches=10, constant=_constant):
    import torch.distributed as dist

    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1 and not dist.is_initialized():  # a rank of run_distributed
        dist.init_process_group("gloo")
    rank = dist.get_rank() if size > 1 else 0
    calls: list = []
    batch, metrics = collect_groups(_fake_draw(rank, size, calls, constant), batch_size,
                                    max_gen_batches, rank, size, None)
    return [tuple(r[:2].tolist()) for r in batch.sequences], batch.scores.tolist(), \
        batch.group_index.tolist(), metrics, calls


def test_constant_groups_are_dropped_and_the_batch_filled():
    """3 of the first batch's 4 groups have one reward for all samples: they are dropped, a
    second prompt batch is drawn, and the first 4 groups whose rewards differ form the step."""
    rows, scores, groups, metrics, calls = _collect()
    assert calls == [0, 1]
    want = [(0, 3), (1, 0), (1, 1), (1, 2)]  # in order; (1, 3) is surplus
    assert rows == [g for g in want for _ in range(N)]
    assert scores == [0.0, 1.0] * 4  # only groups whose rewards differ
    assert groups == [g for g in range(4) for _ in range(N)]
    assert metrics == {"rollout/dynamic_generated": 8.0, "rollout/dynamic_dropped": 3.0,
                       "rollout/dynamic_gen_batches": 2.0}


def test_two_data_parallel_ranks_keep_the_same_groups():
    """DP=2: each rank draws its half, and the kept groups dealt round-robin are DP=1's."""
    one = _collect()
    two = run_distributed(_collect, 2)
    for rank, (rows, _, _, metrics, calls) in enumerate(two):
        assert rows == [r for k, r in enumerate(one[0]) if (k // N) % 2 == rank]
        assert metrics == one[3] and calls == [0, 1]


def test_all_constant_groups_stop_after_max_gen_batches():
    with pytest.raises(RuntimeError, match="algorithm.max_gen_batches=3") as err:
        _collect(max_gen_batches=3, constant=lambda r, i: True)
    assert "0 of data.batch_size=4" in str(err.value) and "12 groups drawn, 12" in str(err.value)


@pytest.mark.parametrize("max_len,buffer,factor", [(16, 4, 1.0), (16, 16, 0.5), (20, 7, 2.0)])
def test_overlong_penalty_is_verls(max_len, buffer, factor):
    """verl 0.9.1 verl/workers/reward_manager/dapo.py, DAPORewardManager.__call__ (its lines,
    with its names, per response)."""
    lengths = torch.arange(0, max_len + 1)
    got = overlong_penalty(lengths, max_len, buffer, factor)
    for valid_response_length, value in zip(lengths.tolist(), got.tolist()):
        # --- copied from verl ---
        overlong_buffer_len = buffer
        expected_len = max_len - overlong_buffer_len
        exceed_len = valid_response_length - expected_len
        overlong_penalty_factor = factor
        overlong_reward = min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)
        # ---
        assert value == pytest.approx(overlong_reward, abs=1e-6), valid_response_length
    assert got[-1] == pytest.approx(-factor) and got[max_len - buffer] == 0


def _half_constant_reward(tmp_path) -> str:
    """A reward file: prompts of even length score 0.5 whatever the response (their groups are
    constant), the others the vowel share of the response."""
    path = tmp_path / "half_constant.py"
    path.write_text(textwrap.dedent('''
        def reward(prompts, responses, **kw):
            return [0.5 if len(p) % 2 == 0 else sum(c in "aeiou" for c in r) / max(len(r), 1)
                    for p, r in zip(prompts, responses)]
        '''))
    return f"{path}:reward"


COMMON = ["trainer.loggers=[jsonl]", "trainer.save_hf_at_end=false", "algorithm.adv_estimator=grpo",
          "algorithm.kl_in_reward=false", "algorithm.dynamic_sampling=true", "data.batch_size=4",
          "actor.mini_batch_size=8", "actor.ppo_epochs=1"]


def test_run_drops_constant_groups_and_resumes_exactly(tmp_path):
    """kill -9 after the step-2 checkpoint, then --resume: step 3 draws the same prompt batches
    (the loader position counts the extra batches) and logs the same metrics."""
    common = [*COMMON, f"reward.function={_half_constant_reward(tmp_path)}",
              "trainer.total_steps=3", "trainer.save_every=2"]
    resume_after_kill_matches(tmp_path, common, steps=3)
    rows = run_metrics(str(tmp_path / "ref"))
    assert all(r["rollout/dynamic_dropped"] > 0 for r in rows), rows
    assert all(r["rollout/dynamic_generated"] == 4 * r["rollout/dynamic_gen_batches"]
               for r in rows)


def test_run_with_every_group_constant_stops_naming_the_setting(tmp_path):
    reward = tmp_path / "constant.py"
    reward.write_text("def reward(prompts, responses, **kw):\n    return [1.0] * len(responses)\n")
    proc = run_ppo([f"trainer.output_dir={tmp_path / 'run'}", *COMMON,
                    f"reward.function={reward}:reward", "algorithm.max_gen_batches=2",
                    "trainer.total_steps=2"], check=False, timeout=240)
    assert proc.returncode != 0
    assert "algorithm.max_gen_batches=2" in proc.stderr, proc.stderr[-2000:]


def test_dapo_example_raises_the_reward(tmp_path):
    """examples/dapo.yaml on the built-in job, shortened like tests/rl/test_ppo.py's default job
    (14 steps): the reward rises, the shaped one and the vowel score alone."""
    out = str(tmp_path / "dapo")
    run_ppo(["--config", os.path.join(ROOT, "examples", "dapo.yaml"),
             f"trainer.output_dir={out}", "trainer.total_steps=14", "trainer.save_every=0",
             "trainer.loggers=[jsonl]", "trainer.save_hf_at_end=false"], timeout=600)
    rows = run_metrics(out)
    assert len(rows) == 14
    assert all("rollout/dynamic_generated" in r and "reward/overlong_penalty" in r for r in rows)
    shaped = [r["reward/mean"] for r in rows]
    raw = [r["reward/mean"] - r["reward/overlong_penalty"] for r in rows]
    for curve in (shaped, raw):
        first, last = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
        assert last > first + 0.1, f"reward did not rise: {curve}"
