"""Qwen3 (per-head q/k RMSNorm, explicit head_dim, no attention bias) against transformers.

The tiny model has head_dim 24 while hidden / heads is 16, and a vocab of 253 (not divisible by
TP). Checked, fp32: logits (CausalLM) and per-token values (Value) max abs <= 1e-4 padded (left
and right) and RmPad at TP=1, TP=2, TP=2 + SP and PP=2; gradients after one backward rel <= 1e-4
at TP=2 (with and without SP), q/k norms included; HF -> ours (TP=2) -> HF and HF -> hf2mcore ->
mcore2hf bit-exact; megatron-core's GPTModel (local spec, qk_layernorm) loads hf2mcore output at
TP=1 and TP=2 and matches transformers (a YaRN Qwen3 too: megatron-core's position_embedding_type
'yarn'); rollout greedy decoding (KV cache) equals transformers.generate; one Adam step at TP=2
through megatron DDP equals transformers + AdamW. Four spawned runs (TP=1, TP=2, PP=2, train).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from parallel_models.testing import run_distributed, run_distributed_jobs, save_tiny_hf_model
from tests.helpers import pipeline_checks
from tests.helpers import qwen3_checks
from tests.checkpoint.test_checkpoint import assert_bit_exact, convert, to_hf

TOL = 1e-4
TIMEOUT = 300
HEADS = ("causal_lm", "value")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 16.0}
FORWARD_KEYS = [f"{head}-{layout}-{side}" for head in HEADS for layout in ("padded", "rmpad")
                for side in ("left", "right")]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    hf = {head: save_tiny_hf_model(str(root / head), "qwen3", head=head, seed=7) for head in HEADS}
    mcore = {head: str(root / f"{head}.mcore") for head in HEADS}
    for head in HEADS:
        convert(hf[head], mcore[head])
    mcore["local"] = str(root / "causal_lm.local.mcore")
    convert(hf["causal_lm"], mcore["local"], layer_spec="local")
    hf["yarn"] = save_tiny_hf_model(str(root / "yarn"), "qwen3", seed=8, rope_scaling=YARN,
                                    max_position_embeddings=64)
    mcore["yarn"] = str(root / "yarn.mcore")
    convert(hf["yarn"], mcore["yarn"])
    return {"root": root, "hf": hf, "mcore": mcore}


def _models(env):
    return {head: env["hf"][head] for head in HEADS}


@pytest.fixture(scope="module")
def tp1(env):
    cases = [{"name": "te-names", "mcore": env["mcore"]["causal_lm"], "hf": env["hf"]["causal_lm"]},
             {"name": "yarn", "mcore": env["mcore"]["yarn"], "hf": env["hf"]["yarn"]}]
    return run_distributed(qwen3_checks.tensor_parallel_run, 1, _models(env), 1, [], cases,
                           timeout=TIMEOUT)


@pytest.fixture(scope="module")
def two_ranks(env):
    """The 2-rank checks (TP=2 forward/saves/generation, PP=2, a TP=2 train step) in one world."""
    root = env["root"]
    saves = [{"src": env["hf"][h], "head": h, "out": str(root / f"{h}.tp2.hf"), "kind": "hf"}
             for h in HEADS]
    saves.append({"src": env["hf"]["causal_lm"], "head": "causal_lm", "kind": "mcore",
                  "out": str(root / "causal_lm.tp2.mcore")})
    saves.append({"src": env["mcore"]["causal_lm"], "head": "causal_lm", "kind": "hf",
                  "out": str(root / "causal_lm.mcore.tp2.hf")})
    cases = [{"name": "te-names", "mcore": env["mcore"]["causal_lm"], "hf": env["hf"]["causal_lm"]}]
    tp2, pp2, train = run_distributed_jobs([
        (qwen3_checks.tensor_parallel_run, (_models(env), 2, saves, cases)),
        (qwen3_checks.pipeline_run, (_models(env), 2)),
        (pipeline_checks.check_train_steps, (env["hf"]["causal_lm"], 2, 1, None, 1))],
        2, timeout=3 * TIMEOUT)
    return {"tp2": tp2, "pp2": pp2, "train": train}


@pytest.fixture(scope="module")
def tp2(two_ranks):
    return two_ranks["tp2"]


@pytest.fixture(scope="module")
def pp2(two_ranks):
    return two_ranks["pp2"]


def test_tiny_model_has_the_shapes_the_tests_rely_on(env):
    cfg = json.loads(open(os.path.join(env["hf"]["causal_lm"], "config.json")).read())
    assert cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
    assert cfg["vocab_size"] % 2 == 1 and cfg["attention_bias"] is False


@pytest.mark.parametrize("key", FORWARD_KEYS)
def test_forward_tp1_matches_transformers(tp1, key):
    err = tp1[0]["forward"][key]
    assert err <= TOL, f"TP=1 {key}: max abs error {err:.3e}"


@pytest.mark.parametrize("key", FORWARD_KEYS + [k + "-sp" for k in FORWARD_KEYS])
def test_forward_tp2_matches_transformers(tp2, key):
    for rank, res in enumerate(tp2):
        err = res["forward"][key]
        assert err <= TOL, f"TP=2 rank {rank} {key}: max abs error {err:.3e}"


def test_registry_picks_the_qwen3_classes(tp1):
    names = {v for k, v in tp1[0]["forward"].items() if k.startswith("class-")}
    assert names == {"Qwen3ForCausalLM", "Qwen3ForCausalLMRmPad", "Qwen3ForValue",
                     "Qwen3ForValueRmPad"}


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_gradients_tp2_match_transformers(tp2, sp):
    for rank, res in enumerate(tp2):
        grads = dict(res["grads"][sp])
        assert grads.pop("unchecked parameters") == []
        assert any("q_layernorm" in n for n in grads) and any("k_layernorm" in n for n in grads)
        worst = max(grads, key=grads.get)
        assert grads[worst] <= TOL, f"rank {rank} sp={sp}: {worst} grad rel error {grads[worst]:.3e}"


@pytest.mark.parametrize("key", ["causal_lm-rmpad", "causal_lm-padded", "value-rmpad",
                                 "value-padded"])
def test_forward_pp2_matches_transformers(pp2, key):
    for rank, res in enumerate(pp2):
        assert res[key] <= TOL, f"PP=2 rank {rank} {key}: max abs error {res[key]:.3e}"


@pytest.mark.parametrize("head", HEADS)
def test_hf_to_ours_tp2_to_hf_is_bit_exact(env, tp2, head):
    assert_bit_exact(env["hf"][head], str(env["root"] / f"{head}.tp2.hf"))


def test_from_pretrained_of_hf2mcore_output_at_tp2_is_bit_exact(env, tp2):
    assert_bit_exact(env["hf"]["causal_lm"], str(env["root"] / "causal_lm.mcore.tp2.hf"))


@pytest.mark.parametrize("setting", ["tp1", "tp2"])
def test_rollout_generation_matches_transformers(tp1, tp2, setting):
    ranks = {"tp1": tp1, "tp2": tp2}[setting]
    for r in ranks:
        gen = r["generation"]
        assert gen["greedy_mismatches"] == [], f"greedy differs for prompts {gen['greedy_mismatches']}"
        assert gen["logp_err"] <= TOL, f"sampling log-probs vs fresh forward: {gen['logp_err']:.2e}"
        assert torch.equal(gen["responses"], ranks[0]["generation"]["responses"])


@pytest.mark.parametrize("which", list(HEADS) + ["local"])
def test_hf2mcore_mcore2hf_is_bit_exact(env, which):
    out = str(env["root"] / f"{which}.back")
    to_hf(env["mcore"][which], out)
    assert_bit_exact(env["hf"]["causal_lm" if which == "local" else which], out)


def test_save_mcore_at_tp2_then_mcore2hf_is_bit_exact(env, tp2):
    out = str(env["root"] / "causal_lm.tp2.mcore.back")
    to_hf(str(env["root"] / "causal_lm.tp2.mcore"), out)
    assert_bit_exact(env["hf"]["causal_lm"], out)


def test_hf2mcore_writes_megatron_core_qk_layernorm(env):
    from parallel_models.llama.checkpoint_utils import McoreCheckpoint
    from parallel_models.registry import weight_map_of
    from safetensors import safe_open

    ck = McoreCheckpoint(env["mcore"]["causal_lm"], weight_map_of("Qwen3ForCausalLM"))
    with safe_open(os.path.join(env["hf"]["causal_lm"], "model.safetensors"), "pt") as f:
        for kind in "qk":
            key = f"decoder.layers.self_attention.{kind}_layernorm.weight"
            assert tuple(ck.tensors[key].size) == (2, 24)  # [layers, head_dim]
            for layer in range(2):
                want = f.get_tensor(f"model.layers.{layer}.self_attn.{kind}_norm.weight")
                assert torch.equal(ck.read_region(key, layer, 0, 24), want)
    info = json.loads(open(os.path.join(env["mcore"]["causal_lm"], "mcore_config.json")).read())
    tc = info["transformer_config"]
    assert (tc["qk_layernorm"], tc["kv_channels"], tc["add_qkv_bias"], tc["add_bias_linear"]) == (
        True, 24, False, False)
    assert info["gpt_model"]["rope_scaling_factor"] == 1.0  # off means off
    assert info["gpt_model"]["position_embedding_type"] == "rope" and not info["notes"]


def test_yarn_is_written_as_megatron_core_yarn(env):
    info = json.loads(open(os.path.join(env["mcore"]["yarn"], "mcore_config.json")).read())
    tc, gpt = info["transformer_config"], info["gpt_model"]
    assert gpt["position_embedding_type"] == "yarn" and not info["notes"]
    assert (gpt["rope_scaling"], gpt["rope_scaling_factor"]) == (False, 1.0)
    assert (tc["yarn_rotary_scaling_factor"], tc["yarn_original_max_position_embeddings"]) == (4.0, 16)
    assert (tc["yarn_beta_fast"], tc["yarn_beta_slow"]) == (16.0, 1.0)
    assert (tc["yarn_mscale"], tc["yarn_mscale_all_dim"]) == (1.0, 0.0)
    assert tc["yarn_correction_range_round_to_int"] is True


@pytest.mark.parametrize("setting,name", [("tp1", "te-names"), ("tp1", "yarn"),
                                          ("tp2", "te-names")])
def test_megatron_gpt_model_loads_hf2mcore_output(tp1, tp2, setting, name):
    """megatron-core's GPTModel (local spec with qk_layernorm, built from the written
    mcore_config.json) loads the hf2mcore output; its logits match transformers' (YaRN
    included: its frequencies and attention factor)."""
    runs = {"tp1": tp1, "tp2": tp2}[setting]
    for rank, res in enumerate(runs):
        err = res["megatron"][name]
        assert err <= TOL, f"{setting} rank {rank} {name}: max |logits - transformers| {err:.3e}"


def test_train_step_tp2_matches_hf_adamw(two_ranks):
    """One Adam step at TP=2 through megatron-core DDP + finalize_model_grads (the q/k norm
    gradients are partial per TP rank: summed there by megatron's qk_layernorm rule) equals
    transformers + torch AdamW."""
    for r in two_ranks["train"]:
        assert r["worst_rel"] <= TOL, f"weights differ from HF after one step: {r['worst_rel']:.2e}"
        for ours, ref in zip(r["norms"], r["hf_norms"]):
            assert abs(ours - ref) <= 1e-5 * ref, f"grad norm {ours} vs HF {ref}"


def test_mcore_config_disagreeing_with_the_hf_config_is_named(env, tmp_path):
    """mcore2hf reads mcore_config.json too: a YaRN checkpoint read with a plain-RoPE HF config
    (same tensor shapes, so nothing else would notice) is refused naming the setting."""
    from parallel_models import CheckpointError

    out = str(tmp_path / "hf")
    with pytest.raises(CheckpointError, match=r"mcore_config.json: gpt_model.position_embedding_"
                                              r"type is 'yarn' but the HF config .* gives 'rope'"):
        to_hf(env["mcore"]["yarn"], out, hf_config=env["hf"]["causal_lm"])
    assert not os.path.exists(out)
