"""A PPO run of the built-in tiny Qwen3-MoE (actor and critic) checkpointed at expert parallel 2
resumes at EP=1 (and the reverse): weights and Adam states bit-exact, the next step's metrics
equal (rel <= 1e-5). Model-level MoE reshards: tests/test_moe_trainer_checkpoint.py."""

import os

import pytest

from parallel_models.testing import run_distributed
from tests import trainer_checkpoint_checks as checks
from tests.ppo_runs import assert_same_trainer_state


MOE_RUN = ["model.path=builtin-moe", "rollout.greedy=true", "trainer.seed=3",
           "actor.moe_aux_loss_coef=0.01"]



@pytest.mark.parametrize("save_ep,load_ep", [(2, 1), (1, 2)], ids=["ep2-to-ep1", "ep1-to-ep2"])
def test_ppo_checkpoint_resumes_at_another_expert_parallel_size(tmp_path, save_ep, load_ep):
    out_a, dump_a = str(tmp_path / "a"), str(tmp_path / "dump_a")
    saved = run_distributed(checks.save_at_step2_then_step, 2, out_a, dump_a, 1, *MOE_RUN,
                            f"parallel.expert_parallel_size={save_ep}", timeout=400)[0]
    out_b, dump_b = str(tmp_path / "b"), str(tmp_path / "dump_b")
    resumed = run_distributed(checks.resume_then_step, 2, out_b, saved["path"], dump_b, 1,
                              os.path.join(out_a, "builtin_moe"), *MOE_RUN,
                              f"parallel.expert_parallel_size={load_ep}", timeout=400)[0]
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
    from tests.ppo_runs import resume_after_kill_matches

    resume_after_kill_matches(tmp_path, ["model.path=builtin-moe", "algorithm.adv_estimator=grpo",
                                         "critic.enable=false", "actor.router_replay=R3",
                                         "trainer.total_steps=4", "trainer.save_every=2",
                                         "trainer.save_hf_at_end=false", "trainer.loggers=[jsonl]"],
                              steps=4)
