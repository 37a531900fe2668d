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
