"""Trainer checkpoints (megatron-core dist checkpoints of models and Adam states,
``rl/roles/sharded_state.py``) of MoE models: saved at one expert-parallel / TP layout, loaded at
another, bit-exact; tiny Qwen3-MoE (a dense layer among MoE layers) and Qwen2-MoE (gated shared
expert). The PPO trainer's resume at another EP: tests/rl/test_moe_ppo_resume.py."""

import os

import pytest
import torch

from parallel_models.testing import run_distributed_jobs, save_tiny_hf_model
from tests.helpers import trainer_checkpoint_checks as checks
from tests.helpers.ppo_runs import load_folder

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py


RESHARD = {"qwen3moe-ep2-to-ep1": ("qwen3_moe", (1, 2), (1, 1)),
           "qwen2moe-tp2-to-ep2": ("qwen2_moe", (2, 1), (1, 2))}


@pytest.fixture(scope="module")
def reshards(tmp_path_factory):
    """Every save and load, one spawned world per world size: the 2-rank world (every save, so
    before any load) first. -> name -> (hf folder, gathered folder)."""
    tmp, jobs, out = tmp_path_factory.mktemp("moe_reshard"), {1: [], 2: []}, {}
    for name, (family, save_at, load_at) in RESHARD.items():
        hf = save_tiny_hf_model(str(tmp / name / "hf"), family, seed=3)
        folder, gathered = str(tmp / name / "ckpt"), str(tmp / name / "gathered")
        for (tp, ep), save in ((save_at, True), (load_at, False)):
            world = max(tp, ep)  # TP=2 or EP=2 (DP=2) on 2 ranks
            assert world == 2 or not save, "saves run in the first (2-rank) world"
            jobs[world].append((checks.roles_roundtrip, (hf, folder, tp, 1, "float32", save,
                                                         gathered, ep)))
        out[name] = (hf, gathered)
    for world in (2, 1):
        run_distributed_jobs(jobs[world], world, timeout=900)
    return out


@pytest.mark.parametrize("name", list(RESHARD))
def test_moe_model_and_optimizer_reshard(reshards, name):
    """Weights and Adam states of an MoE model saved at (TP, EP) load exactly at another
    (TP, EP); every rank of a layout holds its share of the experts (EP) and checks the Adam
    states of its own parameters against the weights they were made from."""
    hf, out = reshards[name]
    want, got = load_folder(hf), load_folder(out)
    assert want.keys() == got.keys()
    assert any(".experts." in k for k in want)
    for k in want:
        assert torch.equal(want[k], got[k]), f"{k} differs after the reshard"
