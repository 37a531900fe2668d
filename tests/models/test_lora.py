"""LoRA on our parallel linears at TP=1 against PEFT's LoRA on the transformers model with the
same weights and adapters (fp32): logits and adapter gradients rel <= 1e-5 for Llama, Qwen2 (qkv
bias) and Qwen3-MoE (attention adapters); the PEFT adapter folder and the merged HF export give
the same logits; fresh adapters change nothing; settings errors name the setting. The TP=2,
TP=2 + SP and PP=2 layouts: tests/distributed/test_lora_parallel.py."""

import pytest

from parallel_models.errors import ConfigError
from parallel_models.lora import LoraSettings
from parallel_models.testing import run_named_jobs, save_tiny_hf_model
from tests.helpers import lora_checks

TOL = 1e-5
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("lora_moe")), "qwen3_moe", seed=1,
                              router_scale=10.0, num_hidden_layers=4)


@pytest.fixture(scope="module")
def results(hf_models, moe_model, tmp_path_factory):
    llama, qwen2 = hf_models[("llama", "causal_lm")], hf_models[("qwen2", "causal_lm")]
    out = str(tmp_path_factory.mktemp("lora_export"))
    named = [("llama", 1, (lora_checks.check_lora_against_peft, (llama, "all-linear", 1, False, 1))),
             ("qwen2", 1, (lora_checks.check_lora_against_peft,
                           (qwen2, ["q_proj", "v_proj", "down_proj", "up_proj"], 1, False, 1))),
             ("moe", 1, (lora_checks.check_lora_against_peft, (moe_model, ATTENTION, 1, False, 1))),
             ("export", 1, (lora_checks.check_export, (qwen2, "all-linear", 1, False, 1, out))),
             ("init", 1, (lora_checks.check_init_and_disable, (llama, 1))),
             ("moe_mlp", 1, (lora_checks.moe_mlp_target_errors, (moe_model,))),
             ("value", 1, (lora_checks.check_value_lora_against_peft,
                           (hf_models[("qwen2", "value")], 1)))]
    return run_named_jobs(named, timeout=900)


@pytest.mark.parametrize("name", ["llama", "qwen2", "moe"])
def test_logits_and_adapter_grads_match_peft(results, name):
    res = results[name][0]
    assert res["grad_names"], "our adapters are not PEFT's set of adapters"
    assert res["logits_rel"] <= TOL, res
    assert res["grad_rel"] <= TOL, res
    assert res["trainable"] == res["peft_trainable"], res
    assert res["frozen_grads"] == 0, "a frozen base weight got a gradient"


def test_value_model_lora_matches_peft_seq_cls(results):
    """The critic's LoRA: adapters plus the whole value head (PEFT's SEQ_CLS modules_to_save)."""
    res = results["value"][0]
    assert res["grad_names"], "our trainable set is not PEFT's (adapters + score)"
    assert res["values_rel"] <= TOL, res
    assert res["grad_rel"] <= TOL, res
    assert res["trainable"] == res["peft_trainable"], res


def test_export_is_read_by_peft_and_merged_export_matches(results):
    res = results["export"][0]
    assert res["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert res["peft_loaded_rel"] <= TOL, res
    assert res["merged_hf_rel"] <= TOL, res
    assert res["in_memory_merged_rel"] <= TOL, res
    assert res["reloaded_rel"] <= TOL, res
    assert res["restored"], "adapters_merged did not restore the base weights exactly"


def test_fresh_adapters_change_nothing_and_disable_gives_the_base(results):
    res = results["init"][0]
    assert res["fresh_equal"] and res["b_zero"], res
    assert res["bounds_ok"], "A is not within PEFT's kaiming-uniform bound"
    assert res["changed"] > 1e-3, "nonzero B did not change the logits"
    assert res["disabled_equal"], "adapters_disabled did not give the base model's logits"


def test_settings_errors_name_the_setting():
    assert LoraSettings(target_modules="all-linear").target_modules == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert LoraSettings(rank=16, alpha=32).scale == 2.0
    with pytest.raises(ConfigError, match="target_modules.*qproj"):
        LoraSettings(target_modules=["qproj"])
    with pytest.raises(ConfigError, match="rank"):
        LoraSettings(rank=0)
    with pytest.raises(ConfigError, match="dropout"):
        LoraSettings(dropout=1.0)
    with pytest.raises(ConfigError, match="use_dora"):
        LoraSettings.from_peft_config({"r": 8, "lora_alpha": 8, "use_dora": True})


def test_moe_refuses_mlp_targets(results):
    """PEFT adapts transformers' fused MoE experts only through ``target_parameters`` (and its
    all-linear adds the router): MLP targets and all-linear on an MoE model are refused, naming
    the setting and what to target instead; attention targets still apply."""
    res = results["moe_mlp"][0]
    for targets in ("all-linear", "['gate_proj']", "['q_proj', 'down_proj']"):
        msg = res[targets]
        assert msg and "lora target_modules" in msg and "MoE" in msg, (targets, msg)
        assert "target_parameters" in msg and "q_proj, k_proj, v_proj, o_proj" in msg, msg
    assert res["attention_trainable"] > 0
