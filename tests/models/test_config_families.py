"""ModelConfig.from_hf for Qwen3, Qwen3-MoE, Qwen2-MoE and Mixtral: every field read from the HF
config, the MoE layers chosen as transformers chooses them (its models are the oracle), and the
errors for settings that cannot work (each names the values)."""

from __future__ import annotations

import pytest
import torch

from parallel_models.config import ConfigError, ModelConfig
from parallel_models.testing import tiny_hf_config

FAMILIES = ("qwen3", "qwen3_moe", "qwen2_moe", "mixtral")


def _hf_moe_layers(hf_config) -> tuple[int, ...]:
    """Layers whose MLP transformers builds as a sparse MoE block (it has a router, `gate`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config)
    return tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")
                 and hasattr(layer.mlp, "experts"))


def test_qwen3_dense_fields():
    cfg = ModelConfig.from_hf(tiny_hf_config("qwen3", head_dim=24, attention_bias=False))
    assert (cfg.model_type, cfg.head_dim, cfg.qk_norm) == ("qwen3", 24, True)
    assert cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads
    assert (cfg.qkv_bias, cfg.o_bias) == (False, False)
    assert (cfg.num_experts, cfg.moe_layer_ids, cfg.is_moe) == (0, (), False)
    biased = ModelConfig.from_hf(tiny_hf_config("qwen3", attention_bias=True))
    assert (biased.qkv_bias, biased.o_bias) == (True, True)


def test_dense_families_keep_dense_defaults():
    for family in ("llama", "qwen2"):
        cfg = ModelConfig.from_hf(tiny_hf_config(family))
        assert not cfg.qk_norm and cfg.num_experts == 0 and cfg.moe_layer_ids == ()
        assert cfg.shared_expert_intermediate_size == 0 and not cfg.shared_expert_gate
    qwen2 = ModelConfig.from_hf(tiny_hf_config("qwen2"))
    assert (qwen2.qkv_bias, qwen2.o_bias) == (True, False)


def test_qwen3_moe_fields():
    hf = tiny_hf_config("qwen3_moe", num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40,
                        norm_topk_prob=False, router_aux_loss_coef=0.02, head_dim=24)
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.qk_norm, cfg.head_dim, cfg.qkv_bias, cfg.o_bias) == (True, 24, False, False)
    assert (cfg.num_experts, cfg.moe_top_k, cfg.moe_intermediate_size) == (8, 3, 40)
    assert (cfg.norm_topk_prob, cfg.router_aux_loss_coef) == (False, 0.02)
    assert (cfg.shared_expert_intermediate_size, cfg.shared_expert_gate) == (0, False)
    assert cfg.intermediate_size == hf.intermediate_size  # the dense layers' width
    assert cfg.moe_layer_ids == _hf_moe_layers(hf) == (0, 2)
    assert cfg.is_moe_layer(0) and not cfg.is_moe_layer(1)


def test_qwen2_moe_fields():
    hf = tiny_hf_config("qwen2_moe", shared_expert_intermediate_size=48, norm_topk_prob=True)
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.o_bias) == (False, True, False)
    assert (cfg.num_experts, cfg.moe_top_k, cfg.moe_intermediate_size) == (4, 2, 32)
    assert (cfg.shared_expert_intermediate_size, cfg.shared_expert_gate) == (48, True)
    assert cfg.norm_topk_prob
    assert cfg.moe_layer_ids == _hf_moe_layers(hf)
    no_bias = ModelConfig.from_hf(tiny_hf_config("qwen2_moe", qkv_bias=False))
    assert not no_bias.qkv_bias


def test_mixtral_fields():
    hf = tiny_hf_config("mixtral", num_local_experts=6, num_experts_per_tok=2, intermediate_size=40,
                        num_hidden_layers=3)
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.num_experts, cfg.moe_top_k, cfg.moe_intermediate_size) == (6, 2, 40)
    assert cfg.norm_topk_prob  # Mixtral always renormalises its top-k
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.shared_expert_intermediate_size) == (False, False, 0)
    assert cfg.moe_layer_ids == _hf_moe_layers(hf) == (0, 1, 2)


@pytest.mark.parametrize("step,mlp_only", [(2, []), (1, [0, 3]), (3, [2]), (2, [1, 99])])
def test_moe_layers_chosen_as_transformers_does(step, mlp_only):
    for family in ("qwen3_moe", "qwen2_moe"):
        hf = tiny_hf_config(family, num_hidden_layers=5, decoder_sparse_step=step,
                            mlp_only_layers=mlp_only)
        assert ModelConfig.from_hf(hf).moe_layer_ids == _hf_moe_layers(hf), (family, step, mlp_only)


def test_zero_experts_is_dense():
    cfg = ModelConfig.from_hf(tiny_hf_config("qwen3_moe", num_experts=0))
    assert cfg.moe_layer_ids == () and not cfg.is_moe


@pytest.mark.parametrize("family", FAMILIES)
def test_sequence_classification_architectures(family, tmp_path):
    hf = tiny_hf_config(family)
    arch = hf.architectures[0].replace("CausalLM", "SequenceClassification")
    hf.architectures = [arch]
    hf.save_pretrained(tmp_path)  # read back from the folder, as from_pretrained does
    cfg = ModelConfig.from_hf(str(tmp_path))
    assert cfg.architecture == arch
    assert cfg.moe_layer_ids == ModelConfig.from_hf(tiny_hf_config(family)).moe_layer_ids


def test_top_k_above_experts_is_named():
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(5\).*num_experts \(4\)"):
        ModelConfig.from_hf(tiny_hf_config("qwen3_moe", num_experts_per_tok=5))
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(3\).*num_experts \(2\)"):
        ModelConfig.from_hf(tiny_hf_config("mixtral", num_local_experts=2, num_experts_per_tok=3))


def test_experts_not_divisible_by_ep_is_named():
    cfg = ModelConfig.from_hf(tiny_hf_config("qwen3_moe", num_experts=6))
    cfg.check_expert_parallel(2)
    cfg.check_expert_parallel(3)
    with pytest.raises(ConfigError, match=r"num_experts \(6\).*expert_model_parallel_size \(4\)"):
        cfg.check_expert_parallel(4)
    with pytest.raises(ConfigError, match=r"expert_model_parallel_size=2.*no MoE layers"):
        ModelConfig.from_hf(tiny_hf_config("qwen3")).check_expert_parallel(2)
    ModelConfig.from_hf(tiny_hf_config("qwen3")).check_expert_parallel(1)


def test_expert_sizes_not_divisible_by_tp_are_named():
    cfg = ModelConfig.from_hf(tiny_hf_config("qwen2_moe", moe_intermediate_size=30))
    with pytest.raises(ConfigError, match=r"moe_intermediate_size \(30\).*tensor_parallel_size \(4\)"):
        cfg.check_tensor_parallel(4)
    cfg = ModelConfig.from_hf(tiny_hf_config("qwen2_moe", shared_expert_intermediate_size=50))
    with pytest.raises(ConfigError, match=r"shared_expert_intermediate_size \(50\).*\(4\)"):
        cfg.check_tensor_parallel(4)


def test_unsupported_router_and_attention_options_are_named():
    with pytest.raises(ConfigError, match=r"router_jitter_noise=0.1"):
        ModelConfig.from_hf(tiny_hf_config("mixtral", router_jitter_noise=0.1))
    with pytest.raises(ConfigError, match=r"decoder_sparse_step must be a positive integer, got 0"):
        ModelConfig.from_hf(tiny_hf_config("qwen3_moe", decoder_sparse_step=0))
    with pytest.raises(ConfigError, match=r"mixtral: sliding-window attention \(sliding_window=64"):
        ModelConfig.from_hf(tiny_hf_config("mixtral", sliding_window=64))
    # which layers slide follows transformers: Qwen3 from max_window_layers on, Qwen2-MoE below it
    for family, window_layers in (("qwen3", 0), ("qwen3_moe", 0), ("qwen2_moe", 28)):
        with pytest.raises(ConfigError, match=rf"{family}: sliding-window attention"):
            ModelConfig.from_hf(tiny_hf_config(family, use_sliding_window=True, sliding_window=64,
                                               max_window_layers=window_layers))
    # a window switched on for no layer is full attention, which is what runs
    ModelConfig.from_hf(tiny_hf_config("qwen2_moe", use_sliding_window=True, sliding_window=64,
                                       max_window_layers=0))


def test_reading_a_config_without_dtype_touches_no_deprecated_attribute(capfd):
    """transformers >= 4.56 names it ``dtype``; reading ``torch_dtype`` warns on stderr, which
    the main job must not print (tests/test_quiet_runs.py)."""
    from transformers import LlamaConfig

    from parallel_models.config import ModelConfig

    cfg = ModelConfig.from_hf(LlamaConfig(num_attention_heads=4, hidden_size=64))
    assert cfg.torch_dtype is None
    assert "deprecated" not in capfd.readouterr().err
    assert ModelConfig.from_hf(LlamaConfig(num_attention_heads=4, hidden_size=64,
                                           dtype="bfloat16")).torch_dtype == "bfloat16"
