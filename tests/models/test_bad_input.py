"""Bad input gets a clear error naming the file, key or setting (single process, world size 1)."""

import json
import os

import pytest
import torch

import parallel_models as pm
from parallel_models.config import ModelConfig
from parallel_models.testing import save_tiny_hf_model, tiny_hf_config


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    pm.init_parallel()
    yield
    pm.destroy_parallel()


@pytest.fixture()
def llama_dir(tmp_path):
    return save_tiny_hf_model(str(tmp_path / "llama"), "llama")


def test_unknown_architecture_lists_supported(llama_dir):
    cfg_path = os.path.join(llama_dir, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["architectures"] = ["MambaForCausalLM"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(pm.ConfigError, match=r"MambaForCausalLM.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        pm.AutoModelForCausalLM.from_pretrained(llama_dir)
    with pytest.raises(pm.ConfigError, match="supported"):
        pm.get_model_class("GPT2LMHeadModel")


def test_heads_or_intermediate_not_divisible():
    cfg = ModelConfig.from_hf(tiny_hf_config("llama", num_attention_heads=4, num_key_value_heads=4))
    with pytest.raises(pm.ConfigError, match=r"num_attention_heads \(4\).*tensor_parallel_size \(3\)"):
        cfg.check_tensor_parallel(3)
    cfg = ModelConfig.from_hf(tiny_hf_config("llama", intermediate_size=90))
    with pytest.raises(pm.ConfigError, match=r"intermediate_size \(90\).*tensor_parallel_size \(4\)"):
        cfg.check_tensor_parallel(4)
    cfg = ModelConfig.from_hf(tiny_hf_config("llama", num_attention_heads=12, num_key_value_heads=3,
                                             hidden_size=96))
    with pytest.raises(pm.ConfigError, match=r"num_key_value_heads \(3\)"):
        cfg.check_tensor_parallel(2)


def test_vocab_padding_for_tp():
    cfg = ModelConfig.from_hf(tiny_hf_config("llama", vocab_size=257))
    assert cfg.padded_vocab_size(2) == 258 and cfg.padded_vocab_size(1) == 257


def test_unsupported_activation():
    with pytest.raises(pm.ConfigError, match="hidden_act='gelu'"):
        ModelConfig.from_hf(tiny_hf_config("llama", hidden_act="gelu"))


def test_missing_tensor_is_named(tmp_path, llama_dir):
    from safetensors.torch import load_file, save_file

    f = os.path.join(llama_dir, "model.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(pm.CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        pm.LlamaForCausalLM.from_pretrained(llama_dir)


def test_corrupt_safetensors_names_the_file(llama_dir):
    f = os.path.join(llama_dir, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 2])  # truncated
    with pytest.raises(pm.CheckpointError, match="model.safetensors"):
        pm.LlamaForCausalLM.from_pretrained(llama_dir)
    open(f, "wb").write(b"\x00" * 64)  # garbage header
    with pytest.raises(pm.CheckpointError, match="model.safetensors"):
        pm.LlamaForCausalLM.from_pretrained(llama_dir)


def test_missing_shard_named_in_index(tmp_path):
    path = save_tiny_hf_model(str(tmp_path / "sharded"), "llama", max_shard_size="50KB")
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    victim = sorted(set(index["weight_map"].values()))[1]
    os.remove(os.path.join(path, victim))
    with pytest.raises(pm.CheckpointError, match=victim):
        pm.LlamaForCausalLM.from_pretrained(path)


def test_pickle_weights_are_refused(tmp_path, llama_dir):
    os.remove(os.path.join(llama_dir, "model.safetensors"))
    torch.save({}, os.path.join(llama_dir, "pytorch_model.bin"))
    with pytest.raises(pm.CheckpointError, match="pickle"):
        pm.LlamaForCausalLM.from_pretrained(llama_dir)


def test_shape_mismatch_names_tensor(llama_dir):
    cfg_path = os.path.join(llama_dir, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["intermediate_size"] = 128
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(pm.CheckpointError, match="gate_proj.weight"):
        pm.LlamaForCausalLM.from_pretrained(llama_dir)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(pm.CheckpointError, match="not a local folder"):
        pm.LlamaForCausalLM.from_pretrained(str(tmp_path / "nope" / "model"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        pm.LlamaForCausalLM.from_pretrained(str(empty))


def test_value_model_from_causal_lm_gets_fresh_head_and_reports_it(llama_dir):
    model = pm.LlamaForValue.from_pretrained(llama_dir)
    assert model.load_report["initialized"] == ["value_head.weight"]
    assert model.load_report["unexpected"] == []
    assert model.value_head.weight.abs().sum() > 0
    ids = torch.randint(0, 100, (2, 7))
    assert model(ids).values.shape == (2, 7)


def test_packed_input_shape_checked(llama_dir):
    model = pm.LlamaForCausalLMRmPad.from_pretrained(llama_dir)
    with pytest.raises(ValueError, match="1-D"):
        model(torch.zeros(2, 3, dtype=torch.long), torch.tensor([0, 3], dtype=torch.int32))
