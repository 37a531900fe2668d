"""The fsdp training backend (parallel.backend=fsdp): one PPO update equals the megatron
backend's at DP=2, packed equals padded, exact resume after a kill, and a family our registry
lacks (transformers' Phi-3) trains with it while the megatron backend refuses it."""

import os
import signal
import subprocess
import time

import torch

from parallel_models.testing import run_distributed, save_tiny_hf_model
from tests import fsdp_checks
from tests.ppo_runs import ENV, PPO
from tests.ppo_runs import load_folder, run_metrics, run_ppo


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    # losses near 0 (whitened advantages cancel): relative to max(|x|, 1)
    return abs(a - b) <= rel * max(abs(a), abs(b), 1.0)


def test_fsdp_update_equals_megatron_dp2(tmp_path):
    """Same weights, batch and seed; several microbatches per rank, clipping active: log-probs,
    values, losses, grad norms and the updated weights of actor and critic agree (fp32); the
    rollout model refilled from the FSDP actor equals it bit for bit."""
    path = save_tiny_hf_model(str(tmp_path / "llama"), "llama", seed=1)
    results = run_distributed(fsdp_checks.fsdp_vs_megatron_step, 2, path, str(tmp_path), 0.5,
                              timeout=300)
    for r in results:
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


def test_fsdp_resume_after_kill_continues_exactly(tmp_path):
    common = ["parallel.backend=fsdp", "trainer.total_steps=5", "trainer.save_every=2",
              "trainer.save_hf_at_end=false", "trainer.loggers=[jsonl]"]
    ref = str(tmp_path / "ref")
    run_ppo([f"trainer.output_dir={ref}", *common])
    killed = str(tmp_path / "killed")
    proc = subprocess.Popen(PPO + [f"trainer.output_dir={killed}", *common], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not os.path.isdir(os.path.join(killed, "checkpoints", "step_000002")):
        assert proc.poll() is None and time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_ppo([f"trainer.output_dir={killed}", *common, "--resume"])
    want, got = run_metrics(ref), run_metrics(killed)
    assert [m["step"] for m in got] == list(range(1, 6))
    for a, b in zip(want, got):
        for key in a:
            if not key.startswith("timing/"):
                assert a[key] == b[key], f"step {a['step']} {key}: {a[key]} vs {b[key]}"


def _tiny_phi3(folder: str, head: str = "causal_lm") -> str:
    """A tiny random transformers Phi-3 (fused qkv / gate_up: not a family of our registry)
    with the built-in tokenizer; ``head="value"``: a Phi3ForSequenceClassification."""
    from transformers import Phi3Config, Phi3ForCausalLM, Phi3ForSequenceClassification

    from parallel_models.rl.tokenizer import build_builtin_tokenizer

    tok = build_builtin_tokenizer()
    config = Phi3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                        num_labels=1)
    torch.manual_seed(0)
    cls = Phi3ForSequenceClassification if head == "value" else Phi3ForCausalLM
    cls(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_unlisted_family_trains_with_fsdp_and_megatron_refuses(tmp_path):
    path = _tiny_phi3(str(tmp_path / "phi3"))
    out = str(tmp_path / "run")
    rows = run_distributed(fsdp_checks.fsdp_ppo_run, 2, out, path, 2, timeout=300)[0]
    assert [r["engine"] for r in rows] == ["HFRolloutEngine"] * 2
    assert all(r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0 for r in rows)
    before, after = load_folder(path), load_folder(os.path.join(out, "actor_hf"))
    assert before.keys() == after.keys()
    assert sum(not torch.equal(before[k], after[k]) for k in before) > len(before) // 2
    proc = run_ppo([f"trainer.output_dir={tmp_path / 'megatron'}", f"model.path={path}",
                    "trainer.total_steps=1"], check=False, timeout=120)
    assert proc.returncode != 0
    assert "Phi3ForCausalLM" in proc.stderr and "parallel.backend=fsdp" in proc.stderr, \
        proc.stderr[-2000:]


def test_fsdp_reward_model_scores_like_transformers(tmp_path):
    """A reward model of a family our registry lacks, sharded over 2 ranks that hold different
    numbers of sequences and microbatches: each score equals transformers' (fp32)."""
    path = _tiny_phi3(str(tmp_path / "phi3_rm"), head="value")
    for got, want in run_distributed(fsdp_checks.fsdp_reward_scores, 2, path, timeout=300):
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-5, (got, want)
