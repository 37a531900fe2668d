"""The fsdp training backend's roles (parallel.backend=fsdp): one PPO update equals the megatron
backend's at DP=2 (packed equals padded, HSDP, activation checkpointing, the rollout model
refilled layer by layer), and the reward model of a family our registry lacks scores like
transformers. Whole runs: tests/rl/test_fsdp_runs.py."""

import pytest
import torch

from parallel_models.testing import run_distributed_jobs, save_tiny_hf_model
from tests.helpers import fsdp_checks
from tests.helpers.ppo_runs import load_folder


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    # losses near 0 (whitened advantages cancel): relative to max(|x|, 1)
    return abs(a - b) <= rel * max(abs(a), abs(b), 1.0)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Both 2-rank checks in one spawned world."""
    tmp = tmp_path_factory.mktemp("fsdp")
    # a pad token that occurs in the sequences: transformers freezes its embedding row
    # (padding_idx), the megatron backend trains it; the fsdp backend must follow megatron
    path = save_tiny_hf_model(str(tmp / "llama"), "llama", seed=1, pad_token_id=3)
    rm_path = fsdp_checks.save_tiny_phi3(str(tmp / "phi3_rm"), head="value")
    step, scores = run_distributed_jobs([
        (fsdp_checks.fsdp_vs_megatron_step, (path, str(tmp), 0.5)),
        (fsdp_checks.fsdp_reward_scores, (rm_path,))], 2, timeout=600)
    return {"path": path, "tmp": tmp, "step": step, "scores": scores}


def test_fsdp_update_equals_megatron_dp2(two_ranks):
    """Same weights, batch and seed; several microbatches per rank, clipping active: log-probs,
    values, losses, grad norms and the updated weights of actor and critic agree (fp32); the
    rollout model refilled from the FSDP actor equals it bit for bit."""
    path, tmp_path = two_ranks["path"], two_ranks["tmp"]
    for r in two_ranks["step"]:
        for key in ("log_probs", "values"):
            a, b = r[key]
            assert (a - b).abs().max() <= 1e-5, f"{key}: {(a - b).abs().max():.2e}"
        lp, lp_padded, v, v_padded = r["padded"]
        assert (lp - lp_padded).abs().max() <= 1e-5 and (v - v_padded).abs().max() <= 1e-5
        for role in ("actor", "critic"):
            meg, fsdp = r[role]
            assert set(meg) == set(fsdp), (sorted(meg), sorted(fsdp))
            for k in meg:
                assert _close(float(meg[k]), float(fsdp[k])), f"{k}: {meg[k]} vs {fsdp[k]}"
            assert meg[f"{role}/grad_norm"] > 0.5  # clipped to 0.5: the clipping is exercised
    base = load_folder(path)
    for role in ("actor", "critic"):
        meg = load_folder(str(tmp_path / f"megatron_{role}"))
        fsdp = load_folder(str(tmp_path / f"fsdp_{role}"))
        assert meg.keys() == fsdp.keys()
        for k in meg:
            rel = ((meg[k] - fsdp[k]).norm() / meg[k].norm()).item()
            assert rel <= 1e-5, f"{role} {k}: rel {rel:.2e}"
        moved = sum(not torch.equal(meg[k], base[k]) for k in meg if k in base)
        assert moved > len(meg) // 2, f"the {role} update did not move the weights"
    # the rollout model refilled layer by layer holds exactly the FSDP actor's weights
    fsdp, rollout = load_folder(str(tmp_path / "fsdp_actor")), load_folder(
        str(tmp_path / "rollout_actor"))
    assert fsdp.keys() == rollout.keys() and all(torch.equal(fsdp[k], rollout[k]) for k in fsdp)


def test_fsdp_reward_model_scores_like_transformers(two_ranks):
    """A reward model of a family our registry lacks, sharded over 2 ranks that hold different
    numbers of sequences and microbatches: each score equals transformers' (fp32)."""
    for got, want in two_ranks["scores"]:
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-5, (got, want)


@pytest.mark.parametrize("override,words", [
    ("parallel.tensor_parallel_size=2", ["parallel.tensor_parallel_size=2", "fsdp"]),
    ("parallel.pipeline_parallel_size=2", ["parallel.pipeline_parallel_size=2", "fsdp"]),
    ("rollout.tensor_parallel_size=2", ["rollout.tensor_parallel_size=2", "fsdp"]),
    ("parallel.backend=deepspeed", ["parallel.backend", "megatron", "fsdp"]),
])
def test_fsdp_settings_that_cannot_work_name_the_key(override, words):
    from parallel_models.errors import ConfigError
    from parallel_models.rl.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["parallel.backend=fsdp", override])
    for w in words:
        assert w in str(e.value), (w, str(e.value))
