"""LoRA on our parallel linears at TP=1 against PEFT's LoRA on the transformers model with the
same weights and adapters (fp32): logits and adapter gradients rel <= 1e-5 for Llama, Qwen2 (qkv
bias), Qwen3-MoE (all-linear: attention and per-expert adapters, PEFT's target_parameters
ParamWrapper on the fused experts, both ways our experts compute) and Qwen2-MoE (shared expert
and dense layer too); the PEFT adapter folder and the merged HF export give the same logits;
fresh adapters change nothing; settings errors name the setting; what PEFT cannot express on an
MoE model is refused. The TP=2, TP=2 + SP, PP=2 and EP=2 layouts:
tests/distributed/test_lora_parallel.py."""

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
    root = tmp_path_factory.mktemp("lora_moe_experts")
    experts = save_tiny_hf_model(str(root / "qwen3_moe"), "qwen3_moe", seed=1, router_scale=10.0,
                                 num_hidden_layers=2, mlp_only_layers=[])
    shared = save_tiny_hf_model(str(root / "qwen2_moe"), "qwen2_moe", seed=1, router_scale=10.0)
    named = [("llama", 1, (lora_checks.check_lora_against_peft, (llama, "all-linear", 1, False, 1))),
             ("qwen2", 1, (lora_checks.check_lora_against_peft,
                           (qwen2, ["q_proj", "v_proj", "down_proj", "up_proj"], 1, False, 1))),
             ("moe", 1, (lora_checks.check_lora_against_peft,
                         (experts, "all-linear", 1, False, 1, 1, False))),
             ("moe_grouped", 1, (lora_checks.check_lora_against_peft,
                                 (experts, ["q_proj", "down_proj"], 1, False, 1, 1, True))),
             ("moe_shared", 1, (lora_checks.check_lora_against_peft,
                                (shared, ["v_proj", "gate_proj", "up_proj", "down_proj"], 1,
                                 False, 1))),
             ("moe_export", 1, (lora_checks.check_export,
                                (experts, "all-linear", 1, False, 1, str(root / "export")))),
             ("export", 1, (lora_checks.check_export, (qwen2, "all-linear", 1, False, 1, out))),
             ("init", 1, (lora_checks.check_init_and_disable, (llama, 1))),
             ("moe_mlp", 1, (lora_checks.moe_mlp_target_errors, (moe_model,))),
             ("value", 1, (lora_checks.check_value_lora_against_peft,
                           (hf_models[("qwen2", "value")], 1)))]
    return run_named_jobs(named, timeout=900)


@pytest.mark.parametrize("name", ["llama", "qwen2", "moe", "moe_grouped", "moe_shared"])
def test_logits_and_adapter_grads_match_peft(results, name):
    res = results[name][0]
    assert res["grad_names"], "our adapters are not PEFT's set of adapters"
    assert res["logits_rel"] <= TOL, res
    assert res["grad_rel"] <= TOL, res
    assert res["trainable"] == res["peft_trainable"] == res["full"], res
    assert res["frozen_grads"] == 0, "a frozen base weight got a gradient"


def test_moe_expert_export_is_read_by_peft(results):
    """``actor_lora/`` of a model with expert adapters (PEFT's target_parameters) is read by
    ``PeftModel.from_pretrained`` and gives our logits, as does the merged ``actor_hf/``."""
    res = results["moe_export"][0]
    assert res["peft_loaded_rel"] <= TOL and res["merged_hf_rel"] <= TOL, res
    assert res["in_memory_merged_rel"] <= TOL and res["reloaded_rel"] <= TOL, res
    assert res["restored"], res


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


def test_moe_refuses_what_peft_cannot_express(results):
    """On an MoE model: gate_proj without up_proj (one fused expert parameter), dropout on
    expert adapters (PEFT's ParamWrapper refuses it), and MLP names on Qwen3-MoE with a dense
    layer (PEFT turns them into the experts' target_parameters, so they cannot reach the dense
    MLP) are refused naming the setting; attention targets still apply."""
    res = results["moe_mlp"][0]
    assert "gate_proj and up_proj" in res["['gate_proj']"], res
    assert "lora dropout" in res["dropout"] and "ParamWrapper" in res["dropout"], res
    for targets in ("all-linear", "['q_proj', 'down_proj']"):
        msg = res[targets]
        assert msg and "lora target_modules" in msg and "dense layers [1]" in msg, (targets, msg)
        assert "q_proj, k_proj, v_proj, o_proj" in msg, msg
    assert res["attention_trainable"] > 0
