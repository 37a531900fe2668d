"""LoRA at TP=2, TP=2 + sequence parallel, PP=2 and EP=2 against PEFT's LoRA on the transformers
model (fp32, rel <= 1e-5): logits and the gathered adapter gradients, dense (Llama, Qwen2 with qkv
bias) and MoE (Qwen3-MoE all-linear: attention and per-expert adapters, PEFT's target_parameters;
Qwen2-MoE's shared expert and dense layer, its experts as grouped GEMMs; megatron-core forces SP
with TP there). Export from TP=2, PP=2 and EP=2: PEFT reads our adapter folder, the merged HF
folder gives our logits. Fresh adapters are the same matrices at TP=1 and TP=2."""

import pytest
import torch

from parallel_models.testing import run_named_jobs, save_tiny_hf_model
from tests.helpers import lora_checks, lora_moe_checks

TOL = 1e-5
LAYOUTS = {"tp2": (2, False, 1, 1), "tp2_sp": (2, True, 1, 1), "pp2": (1, False, 2, 1),
           "ep2": (1, False, 1, 2)}
CASES = [("llama", "all-linear"), ("qwen2", "all-linear"), ("moe", "all-linear"),
         ("moe_shared", "all-linear")]
# MoE at TP=2 always runs with SP (megatron-core's MoE layer), so tp2 is tp2_sp there
PAIRS = [(f, layout) for layout in ("tp2", "tp2_sp", "pp2") for f in ("llama", "qwen2")]
PAIRS += [("moe", "tp2_sp"), ("moe", "pp2"), ("moe", "ep2"), ("moe_shared", "tp2_sp")]
EXPORTS = [("qwen2", "tp2_sp"), ("qwen2", "pp2"), ("moe", "ep2")]


@pytest.fixture(scope="module")
def results(hf_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_moe")
    paths = {"llama": hf_models[("llama", "causal_lm")], "qwen2": hf_models[("qwen2", "causal_lm")],
             "moe": save_tiny_hf_model(str(root / "qwen3_moe"), "qwen3_moe", seed=1,
                                       router_scale=10.0, num_hidden_layers=2, mlp_only_layers=[]),
             "moe_shared": save_tiny_hf_model(str(root / "qwen2_moe"), "qwen2_moe", seed=1,
                                              router_scale=10.0)}
    named = []
    targets_of = dict(CASES)
    for family, layout in PAIRS:
        tp, sp, pp, ep = LAYOUTS[layout]
        grouped = True if family == "moe_shared" else None  # experts as grouped GEMMs
        named.append(((family, layout), max(tp * pp, ep), (
            lora_checks.check_lora_against_peft,
            (paths[family], targets_of[family], tp, sp, pp, ep, grouped))))
    for family, layout in EXPORTS:
        tp, sp, pp, ep = LAYOUTS[layout]
        out = str(tmp_path_factory.mktemp(f"lora_export_{family}_{layout}"))
        named.append((("export", family, layout), max(tp * pp, ep), (
            lora_checks.check_export, (paths[family], "all-linear", tp, sp, pp, out, ep))))
    named += [(("init", tp), tp, (lora_checks.check_init_and_disable, (paths["llama"], tp)))
              for tp in (1, 2)]
    return run_named_jobs(named, timeout=900)


@pytest.mark.parametrize("family,layout", PAIRS)
def test_logits_and_adapter_grads_match_peft(results, family, layout):
    ranks = results[(family, layout)]
    for rank, res in enumerate(ranks):
        assert res["logits_rel"] <= TOL, (rank, res)
        assert res["frozen_grads"] == 0, (rank, res)
    head = ranks[0]
    assert head["grad_names"], head
    assert head["grad_rel"] <= TOL, head
    # each rank holds its share: the counts add up to PEFT's over the TP / PP / EP ranks, and
    # the logged full-size count is PEFT's
    assert sum(r["trainable"] for r in ranks) >= head["peft_trainable"]
    assert all(r["full"] == head["peft_trainable"] for r in ranks), ranks
    if layout == "pp2":
        assert sum(r["trainable"] for r in ranks) == head["peft_trainable"]


@pytest.mark.parametrize("family,layout", EXPORTS)
def test_export_from_parallel_layouts(results, family, layout):
    ranks = results[("export", family, layout)]
    head = ranks[0]
    assert head["peft_loaded_rel"] <= TOL, head
    assert head["merged_hf_rel"] <= TOL, head
    for res in ranks:
        assert res["restored"] and res["reloaded_rel"] <= TOL, res
        assert res["in_memory_merged_rel"] <= TOL, res


def test_fresh_adapters_are_layout_independent(results):
    one, two = results[("init", 1)][0], results[("init", 2)]
    for res in two:
        assert res["fresh_equal"] and res["disabled_equal"] and res["bounds_ok"], res
    assert one["A"].keys() == two[0]["A"].keys()
    for name, a in one["A"].items():
        assert torch.equal(a, two[0]["A"][name]), name


def test_expert_adapter_checkpoint_reshards(hf_models, tmp_path):
    """MoE expert adapters saved at EP=2 load exactly at TP=2 + SP (experts split over ETP)."""
    from parallel_models.testing import run_distributed

    path = save_tiny_hf_model(str(tmp_path / "qwen2_moe"), "qwen2_moe", seed=1, router_scale=10.0)
    folder = str(tmp_path / "ckpt")
    saved = run_distributed(lora_moe_checks.expert_adapter_checkpoint, 2, path, folder, 1, 2, True)[0]
    loaded = run_distributed(lora_moe_checks.expert_adapter_checkpoint, 2, path, folder, 2, 1, False)[0]
    assert saved["names"] and saved["max_diff"] == 0.0, saved
    assert loaded["names"] and loaded["max_diff"] == 0.0, loaded
