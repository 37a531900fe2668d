"""The names an MoE model's norms are saved under, per layer spec (issue 38 item 4), written by
``hf2mcore --layer-spec`` and read back by ``mcore2hf``: ``te`` (transformer-engine: an MoE
layer's pre-MLP norm is ``pre_mlp_layernorm.weight``, a dense layer's is fused into
``linear_fc1``), ``mcore-local`` (megatron-core's local spec with its keys map: fused names
everywhere) and ``local`` (no keys map: module names). The oracle: the keys megatron-core's own
GPTModel declares under each spec (``tests/helpers/moe_spec_names.py``), which must be exactly
the ones we write, and that model loads our checkpoint and matches transformers' logits.
Qwen3-MoE's tiny model has a dense layer (1) among its MoE layers (0, 2)."""

import pytest

from parallel_models.testing import run_distributed
from tests.helpers import moe_spec_names
from tests.helpers.checkpoint_setup import assert_bit_exact
from tests.helpers.moe_checks import save_moe_model

SPECS = ("te", "mcore-local", "local")
TOL = 1e-4
EXPECTED = {  # the pre-MLP norm of layer 0 (MoE) and 1 (dense), the input norm of layer 0
    "te": ("decoder.layers.0.pre_mlp_layernorm.weight",
           "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
           "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"),
    "mcore-local": ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
                    "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
                    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"),
    "local": ("decoder.layers.0.pre_mlp_layernorm.weight",
              "decoder.layers.1.pre_mlp_layernorm.weight",
              "decoder.layers.0.input_layernorm.weight"),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from conversion.hf2mcore import convert_hf_to_mcore

    root = tmp_path_factory.mktemp("moe_norms")
    hf = save_moe_model(str(root / "hf"), "qwen3_moe")
    out = {}
    for spec in SPECS:
        out[spec] = str(root / f"mcore_{spec}")
        convert_hf_to_mcore(hf, out[spec], progress=False, format="flat", layer_spec=spec)
    megatron = run_distributed(moe_spec_names.norm_keys_and_logits, 1,
                               {spec: (spec, out[spec], hf) for spec in SPECS}, timeout=600)[0]
    return {"root": root, "hf": hf, "mcore": out, "megatron": megatron}


def _written_norms(folder):
    from parallel_models.llama.checkpoint_utils.dcp import read_dcp_metadata

    md = read_dcp_metadata(folder).state_dict_metadata
    return sorted(k for k, v in md.items() if hasattr(v, "chunks") and "norm" in k)


@pytest.mark.parametrize("spec", SPECS)
def test_moe_norm_names_written_per_spec(converted, spec):
    written = _written_norms(converted["mcore"][spec])
    for key in EXPECTED[spec]:
        assert key in written, (spec, key, written)
    # megatron-core's own model under that spec declares exactly these norm keys and loads them
    got = converted["megatron"][spec]
    assert got["norms"] == written, (spec, got["norms"], written)
    assert got["logits"] <= TOL, (spec, got)


@pytest.mark.parametrize("spec", SPECS)
def test_moe_norm_names_read_per_spec(converted, spec):
    from conversion.mcore2hf import convert_mcore_to_hf
    from parallel_models.llama.checkpoint_utils.mcore_reader import McoreCheckpoint
    from parallel_models.registry import weight_map_of
    from parallel_models.config import ModelConfig

    back = str(converted["root"] / f"back_{spec}")
    convert_mcore_to_hf(converted["mcore"][spec], back, progress=False)
    assert_bit_exact(converted["hf"], back)
    config = ModelConfig.from_hf(converted["hf"])
    ckpt = McoreCheckpoint(converted["mcore"][spec], weight_map_of(config.architecture))
    assert ckpt.sources["model.layers.0.post_attention_layernorm.weight"].key == EXPECTED[spec][0]
    assert ckpt.sources["model.layers.1.post_attention_layernorm.weight"].key == EXPECTED[spec][1]
    ckpt.close()


def test_unknown_layer_spec_is_named(converted, tmp_path):
    from conversion.hf2mcore import convert_hf_to_mcore
    from parallel_models.config import ConfigError

    with pytest.raises(ConfigError, match="--layer-spec must be one of te, mcore-local, local"):
        convert_hf_to_mcore(converted["hf"], str(tmp_path / "x"), progress=False, layer_spec="tee")
