"""Every rope scaling rule (none, linear, dynamic NTK, llama3, YaRN, longrope) against
transformers, fp32; dynamic and longrope run past their original context so the frequencies
change; YaRN also at TP=2; rope types we do not implement are refused by name."""

import pytest
import torch

import parallel_models as pm
from parallel_models.testing import save_tiny_hf_model

SCALINGS = {
    "none": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
             "beta_fast": 32.0, "beta_slow": 1.0},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 16,
                 "long_factor": [1.0 + 0.25 * i for i in range(8)],
                 "short_factor": [1.0 + 0.05 * i for i in range(8)]},
}


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    pm.init_parallel()
    yield
    pm.destroy_parallel()


def _logits(path, ids):
    model = pm.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(ids, full_vocab=True).logits


@pytest.mark.parametrize("name", list(SCALINGS))
def test_rope_scaling_matches_transformers(tmp_path, name):
    from transformers import AutoModelForCausalLM

    # yarn / longrope scale attention by max_position_embeddings / original (here 4)
    max_pos = 64 if name in ("yarn", "longrope") else 16
    path = save_tiny_hf_model(str(tmp_path / name), "llama", rope_scaling=SCALINGS[name],
                              max_position_embeddings=max_pos)
    model = pm.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.rope_type == ("default" if name == "none" else name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    # > 16 positions (past the original context), then <= 16 (short factors for longrope)
    for length in (40, 12):
        ids = torch.randint(0, 200, (2, length), generator=gen)
        with torch.no_grad():
            ref = hf(input_ids=ids).logits
            got = model(ids, full_vocab=True).logits
        assert (got - ref).abs().max().item() <= 1e-4, (name, length)


def _yarn_tp2(path, ids):
    pm.init_parallel(tensor_parallel_size=2)
    return _logits(path, ids)


def test_yarn_at_tensor_parallel_2_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from parallel_models.testing import run_distributed

    path = save_tiny_hf_model(str(tmp_path / "yarn"), "qwen2", rope_scaling=SCALINGS["yarn"],
                              max_position_embeddings=64)
    ids = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(input_ids=ids).logits
    for got in run_distributed(_yarn_tp2, 2, path, ids, timeout=300):
        assert (got - ref).abs().max().item() <= 1e-4


def test_unimplemented_rope_type_is_refused_by_name(tmp_path):
    import json

    path = save_tiny_hf_model(str(tmp_path / "m"), "llama")
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["rope_scaling"] = {"rope_type": "proportional", "factor": 2.0}
    cfg.pop("rope_parameters", None)
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(pm.ConfigError, match="'proportional' is not supported.*yarn.*longrope"):
        pm.ModelConfig.from_hf(path)
