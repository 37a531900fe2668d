"""Every rope scaling rule (none, linear, dynamic NTK, llama3) against transformers, TP=1, fp32;
dynamic is run past its original context so the frequencies are recomputed."""

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
}


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    pm.init_parallel()
    yield
    pm.destroy_parallel()


@pytest.mark.parametrize("name", list(SCALINGS))
def test_rope_scaling_matches_transformers(tmp_path, name):
    from transformers import AutoModelForCausalLM

    path = save_tiny_hf_model(str(tmp_path / name), "llama", rope_scaling=SCALINGS[name],
                              max_position_embeddings=16)
    model = pm.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.rope_type == ("default" if name == "none" else name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(0))  # > 16 positions
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = model(ids, full_vocab=True).logits
    assert (got - ref).abs().max().item() <= 1e-4
