"""The MoE load-balancing loss at PP=2 on two GPUs (NCCL p2p between the stages,
``layers/moe_aux_carry``): fp32 aux values and router gradients equal transformers' (run on the
CPU; rel 1e-5), and bf16 pipeline messages (the carried fp32 sums and their gradient as bf16
pieces over NCCL) give PP=1's values to fp32 rounding. The CPU suite holds the same checks on
gloo (tests/models/test_moe_aux_loss_pp.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_pp2_aux_loss_over_nccl(tmp_path):
    from parallel_models.testing import run_distributed_jobs
    from tests.helpers import moe_aux_pp_checks
    from tests.helpers import moe_checks

    path = moe_checks.save_moe_model(str(tmp_path / "qwen3_moe"), "qwen3_moe",
                                     num_hidden_layers=4, router_aux_loss_coef=0.01)
    pp2, bf16 = run_distributed_jobs([
        (moe_aux_pp_checks.pp_vs_transformers, ({"qwen3_moe": path}, None)),
        (moe_aux_pp_checks.bf16_pp_equals_pp1, (path,))], 2, timeout=400)
    for r in pp2:
        got = r["qwen3_moe"]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got["aux"], got["hf_aux"])), got
        assert got["grad_rel"] <= 1e-5, got
    for r in bf16:
        print(f"bf16 PP=2 vs PP=1 on rank {r['pp_rank']}: router grads rel {r['grad_rel']:.3g}")
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(r["aux"], r["ref_aux"])), r
        assert r["grad_rel"] <= 1e-6, r
    assert sorted(layer for r in bf16 for layer in r["router_layers"]) == [0, 2, 3]
