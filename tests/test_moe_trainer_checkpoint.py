"""Trainer checkpoints (megatron-core dist checkpoints of models and Adam states,
``rl/sharded_state.py``) of MoE models: saved at one expert-parallel / TP layout, loaded at
another, bit-exact; tiny Qwen3-MoE (a dense layer among MoE layers) and Qwen2-MoE (gated shared
expert). The PPO trainer's resume at another EP: tests/test_moe_ppo_resume.py."""

import os

import pytest
import torch

from parallel_models.testing import run_distributed, save_tiny_hf_model
from tests import trainer_checkpoint_checks as checks
from tests.ppo_runs import load_folder


@pytest.mark.parametrize("family,save_at,load_at", [
    ("qwen3_moe", (1, 2), (1, 1)),
    ("qwen2_moe", (2, 1), (1, 2)),
], ids=["qwen3moe-ep2-to-ep1", "qwen2moe-tp2-to-ep2"])
def test_moe_model_and_optimizer_reshard(tmp_path, family, save_at, load_at):
    """Weights and Adam states of an MoE model saved at (TP, EP) load exactly at another
    (TP, EP); every rank of a layout holds its share of the experts (EP) and checks the Adam
    states of its own parameters against the weights they were made from."""
    hf = save_tiny_hf_model(str(tmp_path / "hf"), family, seed=3)
    folder, out = str(tmp_path / "ckpt"), str(tmp_path / "gathered")
    for (tp, ep), save in ((save_at, True), (load_at, False)):
        world = max(tp, ep)  # TP=2 or EP=2 (DP=2) on 2 ranks
        run_distributed(checks.roles_roundtrip, world, hf, folder, tp, 1, "float32", save, out,
                        ep, timeout=300)
    want, got = load_folder(hf), load_folder(out)
    assert want.keys() == got.keys()
    assert any(".experts." in k for k in want)
    for k in want:
        assert torch.equal(want[k], got[k]), f"{k} differs after the reshard"

