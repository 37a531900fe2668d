"""The MoE load-balancing loss under pipeline parallel (2 gloo ranks, one spawned world): each
stage's router totals ride to the next stage with the activation (``moe_aux_carry``) and the
last stage computes transformers' loss.
- PP=2, fp32, Qwen3-MoE / Qwen2-MoE (a dense layer on the first stage) / Mixtral: each
  microbatch's aux loss and every router weight's gradient of (CE + coef * aux), a global token
  mean over 4 microbatches, equal transformers' (rel 1e-5);
- the same at PP=2 x virtual PP=2 (a chunk without an MoE layer; the interleaved schedule pads
  the microbatches to one token count, and the padding rows stay out of the loss);
- bf16 messages: PP=2 equals PP=1 in bf16 (gradients bit for bit: the carried fp32 sums and
  their gradient travel as bf16 pieces without rounding);
- the RL actor update with ``actor.moe_aux_loss_coef`` at PP=2 equals PP=1 (metrics and router
  gradients), and PP=2 takes the model's ``router_aux_loss_coef`` by default.
And the carry codec itself, in process: exact round trip of values and gradients."""

import pytest
import torch

from parallel_models.testing import run_distributed_jobs
from tests.helpers import moe_aux_pp_checks
from tests.helpers import moe_checks

REL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_aux_pp")
    # 4 layers for the Qwen families (layer 1 dense): 2 per stage, or 1 per virtual stage
    paths = {f: moe_checks.save_moe_model(str(root / f), f, **(
        {} if f == "mixtral" else {"num_hidden_layers": 4, "router_aux_loss_coef": 0.01}))
        for f in moe_checks.MOE_FAMILIES}
    jobs = [(moe_aux_pp_checks.pp_vs_transformers, (paths, None)),
            (moe_aux_pp_checks.pp_vs_transformers, ({"qwen3_moe": paths["qwen3_moe"]}, 2)),
            (moe_aux_pp_checks.bf16_pp_equals_pp1, (paths["qwen3_moe"],)),
            (moe_aux_pp_checks.actor_update_pp2_equals_pp1, (paths["qwen3_moe"],))]
    return dict(zip(["pp2", "vpp2", "bf16", "actor"], run_distributed_jobs(jobs, 2, timeout=600)))


def _close(a, b, rel=REL):
    return abs(a - b) <= rel * max(abs(a), abs(b))


def _check_vs_transformers(per_rank, families):
    layers = {f: [] for f in families}
    for rank, res in enumerate(per_rank):
        assert sorted(res) == sorted(families)
        for family, r in res.items():
            assert len(r["aux"]) == moe_aux_pp_checks.N_MICRO
            for got, want in zip(r["aux"], r["hf_aux"]):
                assert _close(got, want), (rank, family, r["aux"], r["hf_aux"])
            assert r["grad_rel"] <= REL, (rank, family, r)
            layers[family] += r["router_layers"]
    return layers


def test_pp2_equals_transformers(results):
    layers = _check_vs_transformers(results["pp2"], moe_checks.MOE_FAMILIES)
    # every MoE layer's router was checked, on both stages
    assert layers == {"qwen3_moe": [0, 2, 3], "qwen2_moe": [0, 2, 3], "mixtral": [0, 1]}


def test_virtual_pp2_equals_transformers(results):
    layers = _check_vs_transformers(results["vpp2"], ["qwen3_moe"])
    assert layers == {"qwen3_moe": [0, 2, 3]}
    assert [r["qwen3_moe"]["chunk_layers"] for r in results["vpp2"]] == [[[0], [2]], [[1], [3]]]


def test_bf16_pipeline_messages_are_exact(results):
    for r in results["bf16"]:
        for got, want in zip(r["aux"], r["ref_aux"]):
            assert _close(got, want, 1e-6), r
        assert r["grad_rel"] <= 1e-6, r
    assert [r["router_layers"] for r in results["bf16"]] == [[0], [2, 3]]


def test_actor_update_at_pp2_equals_pp1(results):
    for r in results["actor"]:
        assert r["microbatches"] > 1
        assert "actor/moe_aux_loss" in r["pp1"] and r["pp2"].keys() == r["pp1"].keys()
        for key, want in r["pp1"].items():
            assert _close(float(r["pp2"][key]), float(want)) or r["pp2"][key] == want, (key, r)
        assert r["grad_rel"] <= REL, r
        assert r["default_coef"] == 0.01  # no longer dropped with PP > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_carry_round_trip_is_exact(dtype):
    """Probability sums over 12 decades, counts up to 2^40 - 1, and a gradient over 10 decades
    come back bit for bit (the bf16 pieces hold all 24 bits of an fp32)."""
    from parallel_models.llama.layers import moe_aux_carry
    from parallel_models.llama.layers.moe_aux_loss import RouterTotals

    g = torch.Generator().manual_seed(0)
    num_experts, hidden = 64, 48  # several carry rows
    probs = (torch.rand(num_experts, generator=g) *
             10.0 ** torch.randint(-5, 7, (num_experts,), generator=g)).requires_grad_()
    counts = torch.randint(0, 2 ** 40, (num_experts,), generator=g)
    counts[0] = 2 ** 40 - 1
    rows = torch.tensor([2 ** 39 + 12345])
    acts = torch.randn(5, 1, hidden, generator=g).to(dtype).requires_grad_()
    sent = moe_aux_carry.append(acts, RouterTotals(counts, probs, rows))
    k = moe_aux_carry.carry_rows(num_experts, hidden, dtype)
    assert sent.dtype == dtype and sent.shape == (5 + k, 1, hidden) and k > 1
    received = sent.detach().clone().requires_grad_()
    body, totals = moe_aux_carry.strip(received, num_experts)
    assert torch.equal(body, acts.detach())
    assert torch.equal(totals.probs, probs.detach())
    assert torch.equal(totals.counts, counts) and torch.equal(totals.rows, rows)
    grad = torch.randn(num_experts, generator=g) * 10.0 ** torch.randint(
        -6, 4, (num_experts,), generator=g)
    (totals.probs * grad).sum().backward()
    sent.backward(received.grad)  # what the p2p sends back
    assert torch.equal(probs.grad, grad)
    assert torch.equal(acts.grad, torch.zeros_like(acts))
