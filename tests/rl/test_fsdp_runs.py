"""Whole PPO runs with parallel.backend=fsdp: the default job's first steps match the megatron
backend's, exact resume after a kill, and a family our registry lacks (transformers' Phi-3)
trains with it while the megatron backend refuses it (the roles' numbers against the megatron
backend at DP=2: tests/rl/test_fsdp.py)."""

import os

import pytest
import torch

from parallel_models.testing import run_distributed
from tests.helpers import fsdp_checks
from tests.helpers.ppo_runs import load_folder, resume_after_kill_matches, run_metrics, run_ppo

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py


def test_default_job_steps_match_megatron(tmp_path):
    """Two steps of the built-in job, one optimizer step per role and step: the same rollouts
    and rewards (the rollout model is refilled from the FSDP actor), losses and grad norms as the
    megatron backend (fp32)."""
    common = ["trainer.total_steps=2", "actor.ppo_epochs=1", "actor.mini_batch_size=32",
              "trainer.save_every=0", "trainer.save_hf_at_end=false", "trainer.loggers=[jsonl]"]
    runs = {}
    for backend in ("megatron", "fsdp"):
        out = str(tmp_path / backend)
        run_ppo([f"trainer.output_dir={out}", f"parallel.backend={backend}", *common])
        runs[backend] = run_metrics(out)
    for meg, fsdp in zip(runs["megatron"], runs["fsdp"]):
        for key in ("reward/mean", "response_length/mean", "actor/entropy", "actor/grad_norm",
                    "critic/vf_loss", "critic/grad_norm", "kl/actor_ref", "returns/mean"):
            a, b = meg[key], fsdp[key]
            assert abs(a - b) <= 1e-5 * max(abs(a), 1e-2), f"step {meg['step']} {key}: {a} vs {b}"


def test_fsdp_resume_after_kill_continues_exactly(tmp_path):
    resume_after_kill_matches(tmp_path, ["parallel.backend=fsdp", "trainer.total_steps=4",
                                         "trainer.save_every=2", "trainer.save_hf_at_end=false",
                                         "trainer.loggers=[jsonl]"], steps=4)


def test_unlisted_family_trains_with_fsdp_and_megatron_refuses(tmp_path):
    path = fsdp_checks.save_tiny_phi3(str(tmp_path / "phi3"))
    out = str(tmp_path / "run")
    rows = run_distributed(fsdp_checks.fsdp_ppo_run, 2, out, path, 2, timeout=300)[0]
    assert [r["engine"] for r in rows] == ["HFRolloutEngine"] * 2
    assert all(r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0 for r in rows)
    before, after = load_folder(path), load_folder(os.path.join(out, "actor_hf"))
    assert before.keys() == after.keys()
    assert sum(not torch.equal(before[k], after[k]) for k in before) > len(before) // 2
    from parallel_models.errors import ConfigError
    from parallel_models.rl.config import load_config
    from parallel_models.rl.trainer import PPOTrainer

    cfg = load_config(None, [f"trainer.output_dir={tmp_path / 'megatron'}", f"model.path={path}"])
    with pytest.raises(ConfigError, match="Phi3ForCausalLM.*parallel.backend=fsdp"):
        PPOTrainer(cfg)  # refused before any process group or weight
