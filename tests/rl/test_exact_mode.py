"""Exact mode (``rollout.exact``) end to end on the CPU (fp32, Triton interpreter, one gloo
rank): a rollout with continuous arrivals (``ContinuousEngine``) and the actor's log-prob forward
over its tokens, in microbatches of one sequence and of all of them, agree bit for bit, for a
dense Llama and a Qwen3-MoE (router, grouped experts, combine on the exact kernels); the update's
forward with autograd gives the same bits and the reference op's gradients. The config switch
is checked too. (On the GPU in bf16: tests/gpu/test_exact_mode.py.)

Skipped when Triton is not importable (it is not a dependency).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported (the ranks inherit it)
pytest.importorskip("triton")

from parallel_models.testing import run_distributed, save_tiny_hf_model  # noqa: E402
from tests.helpers import exact_checks  # noqa: E402


@pytest.mark.parametrize("family,prompts,new_tokens", [("llama", 4, 5), ("qwen3_moe", 2, 4)])
def test_rollout_log_probs_equal_training_bitwise(tmp_path, family, prompts, new_tokens):
    path = save_tiny_hf_model(str(tmp_path / family), family, seed=0)
    r = run_distributed(exact_checks.check_rollout_vs_training, 1, path, prompts, new_tokens,
                        timeout=300)[0]
    assert r["tokens"] >= 8
    assert r["exact_diff"] == {16: None, 10_000: None}, r["exact_diff"]
    assert r["update_equal"]
    assert r["grad_rel_err"] <= 1e-4
    assert r["normal_diff"] <= 1e-4  # the ordinary kernels agree within fp32 rounding


def test_config_switch():
    from parallel_models.rl.config import PPOConfig

    assert PPOConfig().rollout.exact is False
    assert PPOConfig.model_validate({"rollout": {"exact": True}}).rollout.exact is True
    with pytest.raises(Exception, match="rollout.exact"):
        PPOConfig.model_validate({"rollout": {"exact": True, "backend": "server",
                                              "server_url": "http://x"}})
    with pytest.raises(Exception, match="rollout.tensor_parallel_size=1 != parallel"):
        PPOConfig.model_validate({"rollout": {"exact": True, "tensor_parallel_size": 1},
                                  "parallel": {"tensor_parallel_size": 2}})
