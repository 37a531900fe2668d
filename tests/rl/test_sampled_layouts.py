"""Sampled rollouts do not depend on the layout (issue 30, item 11): each sample is drawn with
noise seeded by (trainer.seed, step, the prompt's place in the global batch, sample index), so 3
sampled PPO steps at TP=2, PP=2 with rollout TP'=2, DP=2 (continuous batching) and through the
rollout server draw the very tokens of the PP=1, TP=1 run on one rank, and their metrics agree
within rel 1e-5; a run saved at one layout and resumed at another draws the same samples; a
sampled validation pass (trainer.val_greedy=false) at DP=2 gives the one-rank pass's results;
the tiny MoE at expert parallel 2 (the rollout records routes) draws its one-rank tokens."""

import pytest

from parallel_models.testing import run_distributed_jobs
from tests.helpers import sampled_ppo_runs as runs
from tests.helpers.hybrid_ppo_runs import assert_same_metrics

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py

LAYOUTS = {
    "tp2": ["parallel.tensor_parallel_size=2"],
    "pp2_rollout_tp2": ["parallel.pipeline_parallel_size=2", "rollout.tensor_parallel_size=2"],
    "dp2_continuous": ["rollout.kv_budget_tokens=96", "rollout.max_batch_rows=3"],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The 1-rank reference (saving after step 2), the 2-rank layouts and a 2-rank (DP=2)
    resume of the reference's step-2 checkpoint."""
    tmp = tmp_path_factory.mktemp("sampled")
    ref = run_distributed_jobs([(runs.sampled_run, (str(tmp / "ref"), []), {"save_after": 2})],
                               1, timeout=600)[0]
    val = ("data.task=add_mod10", "trainer.val_greedy=false", "data.val_batch_size=3")
    # no load-balancing loss: its statistic is per data-parallel rank (1 rank vs DP=2 differ)
    moe = ("model.path=builtin-moe", "actor.moe_aux_loss_coef=0.0")
    ref_val, ref_moe = run_distributed_jobs([
        (runs.sampled_run, (str(tmp / "val_ref"), []), {"steps": 1, "extra": val,
                                                        "validate": True}),
        (runs.sampled_run, (str(tmp / "moe_ref"), []), {"steps": 2, "extra": moe})],
        1, timeout=600)
    model = f"model.path={tmp / 'ref' / 'builtin_model'}"
    jobs = [(runs.sampled_run, (str(tmp / name), layout), {}) for name, layout in LAYOUTS.items()]
    jobs.append((runs.sampled_run, (str(tmp / "resume"), []),
                 {"steps": 1, "resume_from": ref[0]["checkpoint"], "extra": (model,)}))
    jobs.append((runs.sampled_run, (str(tmp / "val_dp2"), []),
                 {"steps": 1, "extra": val, "validate": True}))
    jobs.append((runs.sampled_run, (str(tmp / "moe_ep2"), ["parallel.expert_parallel_size=2"]),
                 {"steps": 2, "extra": moe}))
    out = dict(zip([*LAYOUTS, "resume", "val_dp2", "moe_ep2"],
                   run_distributed_jobs(jobs, 2, timeout=1200)))
    out["ref"], out["val_ref"], out["moe_ref"] = ref, ref_val, ref_moe
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sampled_layout_draws_the_reference_tokens(results, name):
    want = runs.merged_tokens(results["ref"])
    got = runs.merged_tokens(results[name])
    assert [sorted(s) for s in want] == [[0, 1, 2, 3]] * 3
    assert got == want, f"{name}: other samples drawn than at PP=1, TP=1"
    assert results[name][0]["continuous"] == (name == "dp2_continuous")
    assert_same_metrics(results[name][0]["metrics"], results["ref"][0]["metrics"], name)


def test_samples_differ_across_steps_prompts_and_samples(results):
    """The seeds really vary: the two samples of a prompt differ, and step 1 is not step 2."""
    steps = runs.merged_tokens(results["ref"])
    assert any(rows[0] != rows[1] for s in steps for rows in s.values())
    assert steps[0] != steps[1]


def test_resume_at_another_layout_draws_the_same_samples(results):
    """Saved after step 2 on one rank, resumed at DP=2: step 3 draws the reference's tokens."""
    assert results["resume"][0]["step"] == 3
    got = runs.merged_tokens(results["resume"])
    assert got == runs.merged_tokens(results["ref"])[2:]
    want, have = results["ref"][0]["metrics"][2], results["resume"][0]["metrics"][0]
    for k in ("reward/mean", "response_length/mean", "actor/pg_loss", "critic/vf_loss"):
        assert abs(want[k] - have[k]) <= 1e-5 * max(abs(want[k]), 1.0), (k, want[k], have[k])


def test_sampled_validation_at_dp2_equals_one_rank(results):
    want, got = results["val_ref"][0]["validation"], results["val_dp2"][0]["validation"]
    assert runs.merged_tokens(results["val_dp2"]) == runs.merged_tokens(results["val_ref"])
    assert want["metrics"].keys() == got["metrics"].keys()
    for k, v in want["metrics"].items():
        assert abs(got["metrics"][k] - v) <= 1e-5 * max(abs(v), 1.0), (k, v, got["metrics"][k])
    # each DP rank logs its own first samples: those the one-rank pass logged too are equal
    logged = {r["prompt"]: r for r in want["samples"]}
    shared = [r for rank in results["val_dp2"] for r in rank["validation"]["samples"]
              if r["prompt"] in logged]
    assert len(shared) >= 2 and all(r == logged[r["prompt"]] for r in shared)


def test_sampled_moe_at_ep2_draws_the_one_rank_tokens(results):
    want, got = results["moe_ref"], results["moe_ep2"]
    assert runs.merged_tokens(got) == runs.merged_tokens(want)
    for step, (g, w) in enumerate(zip(got[0]["metrics"], want[0]["metrics"])):
        assert g.keys() == w.keys()
        for k in set(w) - {"actor/moe_aux_loss"}:  # a per-rank statistic (reported, not used)
            tol = 1e-5 * max(abs(w[k]), abs(g[k])) + 1e-6
            assert abs(g[k] - w[k]) <= tol, f"EP=2 step {step + 1} {k}: {g[k]} vs {w[k]}"
