"""Exact mode at TP=2 on the CPU (fp32, Triton interpreter, two gloo ranks): the continuous
rollout's log-probs equal the actor's log-prob forward and the update's forward bit for bit on
every rank (row-parallel sums of two ranks are order-free; the training side gathers the
vocab-parallel logits to the sampler's full vocab). The MoE model, whose training forward runs
with sequence parallel, passes the same check (not run here to stay under a minute; the GPU
file runs both at TP=2 on two GPUs).

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


def test_tp2_rollout_log_probs_equal_training_bitwise(tmp_path):
    path = save_tiny_hf_model(str(tmp_path / "llama"), "llama", seed=0)
    results = run_distributed(exact_checks.check_rollout_vs_training, 2, path, 3, 4, tp=2,
                              timeout=300)
    for r in results:
        assert r["tokens"] >= 8
        assert r["exact_diff"] == {16: None, 10_000: None}, r["exact_diff"]
        assert r["update_equal"]
        assert r["grad_rel_err"] <= 1e-4
    assert results[0] == results[1]
