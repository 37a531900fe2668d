"""The family registry (``parallel_models/llama/families/``) is consistent: every registered
family has its classes and architectures in the public registry, builds a tiny model that
matches transformers' on the same weights (fp32, TP=1, max abs <= 1e-4), its weight map covers
every tensor of its HF checkpoint and round-trips it (shard at TP=1 and 2, then merge, and
to_mcore then from_mcore: bit exact), and its megatron settings read back as the same family."""

from __future__ import annotations

import pytest
import torch

import parallel_models as pm
from parallel_models.llama.families import all_families, family_of_model_type
from parallel_models.testing import TensorDictReader, save_tiny_hf_model
from tests.helpers.checkpoint_setup import load_all

FAMILIES = [f.model_type for f in all_families()]
ROUTER_SCALE = 25.0  # wide routing margins for the MoE families (as tests/helpers/moe_checks)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {(f.model_type, head): save_tiny_hf_model(
                str(root / f"{f.model_type}_{head}"), f.model_type, head=head, seed=3,
                router_scale=ROUTER_SCALE if f.moe_hf_names else None)
            for f in all_families() for head in ("causal_lm", "value")}


def test_registry_lists_every_family():
    from parallel_models import models, registry

    assert len(FAMILIES) == len(set(FAMILIES)) >= 7
    for family in all_families():
        for arch in family.architectures:
            assert registry.ARCHITECTURES[arch] == family.name
        for suffix in ("ForCausalLM", "ForCausalLMRmPad", "ForValue", "ForValueRmPadPP"):
            cls = getattr(models, family.name + suffix)
            assert cls.weight_map.family == family.name and getattr(pm, cls.__name__) is cls
    assert set(registry.ARCHITECTURES.values()) == {f.name for f in all_families()}


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("head", ["causal_lm", "value"])
def test_weight_map_covers_and_round_trips_the_checkpoint(folders, model_type, head):
    from parallel_models.config import ModelConfig
    from parallel_models.registry import weight_map_of

    path = folders[(model_type, head)]
    config = ModelConfig.from_hf(path)
    tensors = load_all(path)
    reader = TensorDictReader(tensors)
    seen = set()
    for m, layer in weight_map_of(config.architecture).global_jobs(config, head):
        names = m.hf_names(layer)
        seen.update(names)
        want = [tensors[n] for n in names]
        for tp in (1, 2):
            if tp == 2 and (config.num_attention_heads % 2 or config.num_key_value_heads % 2):
                continue
            shards = [m.rule.shard(reader, names, config, tp, r) for r in range(tp)]
            got = m.rule.merge(shards, config)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (model_type, names, tp)
        back = m.rule.from_mcore(m.rule.to_mcore(want, config), config)
        assert all(torch.equal(a, b) for a, b in zip(back, want)), (model_type, names, "mcore")
    assert seen == set(tensors), f"{model_type}: unmapped {sorted(set(tensors) - seen)}"


@pytest.mark.parametrize("model_type", FAMILIES)
def test_tiny_model_matches_transformers(folders, model_type):
    from tests.helpers.model_checks import _batch, ours_and_reference

    path = folders[(model_type, "causal_lm")]
    pm.init_parallel(tensor_parallel_size=1)
    try:
        model = pm.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert type(model).__name__ == f"{family_of_model_type(model_type, default=None).name}ForCausalLM"
        ids, mask = _batch(model.config.vocab_size, "right")
        got, ref = ours_and_reference(model, path, "causal_lm", False, ids, mask)
        err = (got - ref[mask.bool()]).abs().max().item()
        assert err <= 1e-4, f"{model_type}: max abs error {err:.3e}"
    finally:
        pm.destroy_parallel()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_megatron_settings_read_back_as_the_family(model_type):
    """The family's megatron settings (Bridge run config) are recognised as that family."""
    from parallel_models.config import ModelConfig
    from parallel_models.llama.checkpoint_utils.megatron_format import mcore_config_dict
    from parallel_models.llama.checkpoint_utils.megatron_hf_config import (
        _fields_from_run_config, hf_config_from_fields)
    from parallel_models.llama.checkpoint_utils.megatron_layout import bridge_run_config
    from parallel_models.testing import tiny_hf_config

    config = ModelConfig.from_hf(tiny_hf_config(model_type))
    info = mcore_config_dict(config, head_kind="causal_lm", dtype=torch.float32, layer_spec="te")
    fields = _fields_from_run_config(bridge_run_config(info))
    back = ModelConfig.from_hf(hf_config_from_fields(fields, "<test>"))
    assert back.model_type == model_type
    for key in ("qkv_bias", "o_bias", "qk_norm", "hidden_act", "norm_unit_offset",
                "embedding_multiplier", "num_experts", "moe_layer_ids", "head_dim",
                "shared_expert_intermediate_size", "tie_word_embeddings"):
        assert getattr(back, key) == getattr(config, key), (model_type, key)
