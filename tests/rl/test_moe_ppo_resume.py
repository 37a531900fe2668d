"""A PPO run of the built-in tiny Qwen3-MoE (actor and critic) checkpointed at expert parallel 2
resumes at EP=1 (and the reverse): weights and Adam states bit-exact, the next step's metrics
equal (rel <= 1e-5). Model-level MoE reshards: tests/rl/test_moe_trainer_checkpoint.py."""

import os

import pytest

from parallel_models.testing import run_distributed_jobs
from tests.helpers import trainer_checkpoint_checks as checks
from tests.helpers.ppo_runs import assert_same_trainer_state

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py


MOE_RUN = ["model.path=builtin-moe", "rollout.greedy=true", "trainer.seed=3",
           "actor.moe_aux_loss_coef=0.01"]



RESUME = {"ep2-to-ep1": (2, 1), "ep1-to-ep2": (1, 2)}  # save_ep, load_ep


@pytest.fixture(scope="module")
def resumes(tmp_path_factory):
    """Both saves in one 2-rank world, then both resumes in another."""
    tmp = {name: tmp_path_factory.mktemp(name) for name in RESUME}
    saves = run_distributed_jobs([
        (checks.save_at_step2_then_step, (str(tmp[name] / "a"), str(tmp[name] / "dump_a"), 1,
                                          *MOE_RUN, f"parallel.expert_parallel_size={save_ep}"))
        for name, (save_ep, _) in RESUME.items()], 2, timeout=800)
    loads = run_distributed_jobs([
        (checks.resume_then_step, (str(tmp[name] / "b"), saved[0]["path"],
                                   str(tmp[name] / "dump_b"), 1,
                                   os.path.join(str(tmp[name] / "a"), "builtin_moe"), *MOE_RUN,
                                   f"parallel.expert_parallel_size={load_ep}"))
        for (name, (_, load_ep)), saved in zip(RESUME.items(), saves)], 2, timeout=800)
    return {name: (tmp[name], saved[0], resumed[0])
            for name, saved, resumed in zip(RESUME, saves, loads)}


@pytest.mark.parametrize("name", list(RESUME))
def test_ppo_checkpoint_resumes_at_another_expert_parallel_size(resumes, name):
    save_ep, load_ep = RESUME[name]
    tmp_path, saved, resumed = resumes[name]
    dump_a, dump_b = str(tmp_path / "dump_a"), str(tmp_path / "dump_b")
    assert resumed["step"] == 2
    assert_same_trainer_state(dump_a, dump_b)
    want, got = saved["metrics"], resumed["metrics"]
    assert want.keys() == got.keys() and "actor/moe_aux_loss" in want
    for key in want:
        if not key.startswith(("timing/", "memory/")):
            tol = 1e-5 * max(abs(want[key]), abs(got[key])) + 1e-6
            assert abs(want[key] - got[key]) <= tol, f"{key}: EP={save_ep} {want[key]} vs " \
                                                     f"EP={load_ep} {got[key]}"


def test_moe_run_resumes_after_kill_from_its_periodic_checkpoint(tmp_path):
    """The user's path: `parallel-models-ppo model.path=builtin-moe` writes its periodic
    checkpoints (router replay R3 on), is SIGKILLed, and `--resume` continues exactly."""
    from tests.helpers.ppo_runs import resume_after_kill_matches

    resume_after_kill_matches(tmp_path, ["model.path=builtin-moe", "algorithm.adv_estimator=grpo",
                                         "critic.enable=false", "actor.router_replay=R3",
                                         "trainer.total_steps=4", "trainer.save_every=2",
                                         "trainer.save_hf_at_end=false", "trainer.loggers=[jsonl]"],
                              steps=4)
