"""megatron-core GPTModels (MoE block spec) that save their norms under each layer spec's names,
for the MoE norm-name tests (issue 38 item 4), run on gloo ranks.

megatron-core 0.16's local spec (``get_gpt_layer_local_spec``) maps ``input_layernorm.`` and
``pre_mlp_layernorm.`` to the fused transformer-engine names in its
``sharded_state_dict_keys_map``, on MoE layers too (``mcore-local``). Its transformer-engine spec
(``get_gpt_layer_with_transformer_engine_spec``) fuses the input norm into ``linear_qkv`` and a
dense layer's pre-MLP norm into ``linear_fc1``, but gives an MoE layer a separate
``pre_mlp_layernorm=backend.layer_norm()`` with no key map: saved as
``pre_mlp_layernorm.weight``. transformer-engine is not installed here, so the ``te`` naming is
megatron-core's local spec with the ``pre_mlp_layernorm.`` entry dropped on MoE layers (the module
names and every other key are the same); ``local`` drops the whole map.
"""

from __future__ import annotations

import dataclasses




def rename_norms(model, naming: str):
    """Make megatron-core ``model`` (built with the local MoE block spec) save under ``naming``
    ("te", "mcore-local" or "local")."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for layer in model.decoder.layers:
        keys = dict(layer.submodules_config.sharded_state_dict_keys_map)
        if naming == "local":
            keys = {}
        elif naming == "te" and isinstance(layer.mlp, MoELayer):
            keys.pop("pre_mlp_layernorm.", None)
        layer.submodules_config = dataclasses.replace(layer.submodules_config,
                                                      sharded_state_dict_keys_map=keys)
    return model


def norm_keys_and_logits(cases: dict) -> dict:
    """Each case name -> (naming, our dist checkpoint, HF folder): a megatron-core GPTModel
    saving under that naming; its norm keys, and after loading our checkpoint its max |logits -
    transformers' logits|."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import parallel_models as pm
    from parallel_models import cpu_shim
    from parallel_models.llama.checkpoint_utils import build_gpt_model
    from tests.helpers.checkpoint_checks import _megatron_logits, hf_logits, token_batch

    pm.init_parallel(tensor_parallel_size=1)
    out = {}
    for name, (naming, mcore, hf) in cases.items():
        cfg = pm.ModelConfig.from_hf(hf)
        ids = token_batch(cfg.vocab_size)
        with cpu_shim.cuda_to_cpu():
            model_parallel_cuda_manual_seed(0)
            model = build_gpt_model(mcore, layer_spec="local", parallel_output=False,
                                    transformer_config={"perform_initialization": False})
            model = rename_norms(model.eval(), naming)
            sharded = model.sharded_state_dict()
            norms = sorted(v.key for v in sharded.values()
                           if hasattr(v, "key") and "norm" in v.key and "._extra" not in v.key)
            model.load_state_dict(dist_checkpointing.load(sharded, mcore))
            got = _megatron_logits(model, ids, cfg.vocab_size)
        out[name] = {"norms": norms, "logits": (got - hf_logits(hf, ids)).abs().max().item()}
    return out


__all__ = ["rename_norms", "norm_keys_and_logits"]
