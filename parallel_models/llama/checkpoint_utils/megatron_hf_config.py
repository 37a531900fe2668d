"""The HF config a Megatron-LM or Megatron-Bridge checkpoint describes, for checkpoints that carry
no ``config.json`` (``mcore2hf`` without ``--hf-config``).

The model's settings come from Bridge's ``run_config.yaml`` (the ``model`` section: a
``GPTModelProvider``'s fields, megatron-core ``TransformerConfig`` names) or else from Megatron-LM's
``args`` in the common state (Megatron-LM's argument names); both are first put under the
``TransformerConfig`` names, then mapped to a transformers config. The family is read from the
settings (megatron-core saves no HF architecture): each registered family says whether the
settings match it (``Family.matches_megatron``; e.g. q/k norms -> Qwen3, Qwen3-MoE with experts;
a bias on qkv only -> Qwen2; zero-centered norms -> Gemma; else Llama) and adds its own HF
arguments. The vocab is the embedding's stored rows when known (Megatron-LM pads it).
"""

from __future__ import annotations

import os

from parallel_models.llama.checkpoint_utils.errors import CheckpointError
from parallel_models.llama.checkpoint_utils.megatron_format import COMMON_FILE
from parallel_models.llama.checkpoint_utils.megatron_layout import (RUN_CONFIG_FILE,
                                                                    read_megatron_lm_args,
                                                                    read_run_config)
from parallel_models.llama.families import family_from_megatron

# TransformerConfig / GPTModelProvider name -> Megatron-LM argument name, where they differ
_ARG_NAMES = {"layernorm_epsilon": "norm_epsilon", "num_moe_experts": "num_experts",
              "rope_scaling": "use_rope_scaling",
              "seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor",
              "seq_length": "max_position_embeddings",
              "layernorm_zero_centered_gamma": "apply_layernorm_1p"}
_REQUIRED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
_OPTIONAL = ("num_query_groups", "kv_channels", "layernorm_epsilon", "add_bias_linear",
             "add_qkv_bias", "qk_layernorm", "init_method_std", "vocab_size", "seq_length",
             "share_embeddings_and_output_weights", "position_embedding_type", "rotary_base",
             "rope_scaling", "rope_scaling_factor", "seq_len_interpolation_factor",
             "normalization", "gated_linear_unit", "bf16", "fp16", "num_moe_experts",
             "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_pre_softmax",
             "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
             "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings",
             "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim",
             "yarn_correction_range_round_to_int", "layernorm_zero_centered_gamma")
# the gated MLP's activation: megatron's function name -> HF hidden_act
# (Bridge writes megatron.core.activations.fast_gelu, Megatron-LM has --openai-gelu: both GELU-tanh)
_ACTIVATIONS = {"silu": "silu", "fast_gelu": "gelu_pytorch_tanh",
                "openai_gelu": "gelu_pytorch_tanh"}


def _fields_from_run_config(run: dict) -> dict:
    model = run["model"]
    out = {k: model.get(k) for k in _REQUIRED + _OPTIONAL}
    dtype = model.get("params_dtype")
    if isinstance(dtype, dict):
        dtype = dtype.get("_target_")
    out["dtype"] = str(dtype).replace("torch.", "") if dtype else None
    act = model.get("activation_func")
    out["activation"] = (act.get("_target_") if isinstance(act, dict) else act) or ""
    return out


def _fields_from_args(args) -> dict:
    get = lambda name: getattr(args, _ARG_NAMES.get(name, name), None)  # noqa: E731
    out = {k: get(k) for k in _REQUIRED + _OPTIONAL}
    out["seq_length"] = get("seq_length") or getattr(args, "seq_length", None)
    out["share_embeddings_and_output_weights"] = not getattr(
        args, "untie_embeddings_and_output_weights", False)
    swiglu = bool(getattr(args, "swiglu", False))
    out["gated_linear_unit"] = swiglu or bool(getattr(args, "gated_linear_unit", False))
    out["activation"] = ("silu" if swiglu else "openai_gelu" if getattr(args, "openai_gelu", False)
                         else "other")
    if not getattr(args, "group_query_attention", False):
        out["num_query_groups"] = None
    out["vocab_size"] = getattr(args, "padded_vocab_size", None) or get("vocab_size")
    dtype = getattr(args, "params_dtype", None)
    out["dtype"] = str(dtype).replace("torch.", "") if dtype is not None else (
        "bfloat16" if out["bf16"] else "float16" if out["fp16"] else "float32")
    return out


def _activation(f: dict) -> str | None:
    """The HF hidden_act of the settings' gated MLP (None: not a gated MLP we implement)."""
    if f.get("gated_linear_unit") is False:
        return None
    name = str(f.get("activation", "silu")).rpartition(".")[2]
    return _ACTIVATIONS.get(name)


def _rope_scaling(f: dict) -> dict | None:
    if f["position_embedding_type"] == "yarn":
        rs = {"rope_type": "yarn", "factor": float(f["yarn_rotary_scaling_factor"]),
              "original_max_position_embeddings": int(f["yarn_original_max_position_embeddings"])}
        # HF's defaults (beta_fast 32, beta_slow 1, truncate) are left out, as HF configs do
        if float(f["yarn_beta_fast"] or 32) != 32:
            rs["beta_fast"] = float(f["yarn_beta_fast"])
        if float(f["yarn_beta_slow"] or 1) != 1:
            rs["beta_slow"] = float(f["yarn_beta_slow"])
        if f["yarn_correction_range_round_to_int"] is False:
            rs["truncate"] = False
        if f["yarn_mscale"] and f["yarn_mscale_all_dim"]:
            rs.update(mscale=float(f["yarn_mscale"]), mscale_all_dim=float(f["yarn_mscale_all_dim"]))
        return rs
    if f["rope_scaling"]:  # megatron-core's llama3 scaling (its other settings fixed)
        return {"rope_type": "llama3", "factor": float(f["rope_scaling_factor"]),
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
    if f["seq_len_interpolation_factor"]:
        return {"rope_type": "linear", "factor": float(f["seq_len_interpolation_factor"])}
    return None


def hf_config_from_fields(f: dict, source: str, vocab_rows: int | None = None):
    """A transformers config from the normalized fields ``f`` (``source`` names the file in
    errors)."""
    from transformers import AutoConfig

    missing = [k for k in _REQUIRED if f.get(k) is None]
    if vocab_rows is None and f.get("vocab_size") is None:
        missing.append("vocab_size")
    if f.get("seq_length") is None:
        missing.append("seq_length (max_position_embeddings)")
    if missing:
        raise CheckpointError(f"{source}: lacks {', '.join(missing)}; pass --hf-config DIR "
                              "(a folder with the model's HF config.json)")
    unsupported = []
    if (f.get("normalization") or "RMSNorm") != "RMSNorm":
        unsupported.append(f"normalization={f['normalization']!r} (RMSNorm only)")
    act = _activation(f)
    if act is None:
        unsupported.append(f"an MLP other than a gated one with {' / '.join(_ACTIVATIONS)} "
                           f"(activation {f.get('activation')!r})")
    if (f.get("position_embedding_type") or "rope") not in ("rope", "yarn"):
        unsupported.append(f"position_embedding_type={f['position_embedding_type']!r}")
    if unsupported:
        raise CheckpointError(f"{source}: not a Llama/Qwen model: {'; '.join(unsupported)}")
    family = family_from_megatron(f)
    heads = f["num_attention_heads"]
    kw = dict(architectures=[f"{family.name}ForCausalLM"], hidden_size=f["hidden_size"],
              num_hidden_layers=f["num_layers"], num_attention_heads=heads,
              num_key_value_heads=f["num_query_groups"] or heads,
              head_dim=f["kv_channels"] or f["hidden_size"] // heads,
              intermediate_size=f["ffn_hidden_size"],
              vocab_size=vocab_rows if vocab_rows is not None else f["vocab_size"],
              max_position_embeddings=f["seq_length"],
              rms_norm_eps=f["layernorm_epsilon"] if f["layernorm_epsilon"] is not None else 1e-5,
              rope_theta=float(f["rotary_base"] or 10000),
              tie_word_embeddings=bool(f["share_embeddings_and_output_weights"]),
              initializer_range=f["init_method_std"] or 0.02, hidden_act=act,
              dtype=f.get("dtype") or "float32")
    rope = _rope_scaling(f)
    if rope is not None:
        kw["rope_scaling"] = rope
    kw.update(family.hf_kwargs_from_megatron(f))
    return AutoConfig.for_model(family.model_type, **kw)


def hf_config_from_megatron(folder: str, vocab_rows: int | None = None):
    """The HF config of the dist checkpoint in ``folder`` from its ``run_config.yaml`` (Bridge) or
    the Megatron-LM ``args`` of its common state; a CheckpointError naming what is missing."""
    run = read_run_config(folder)
    if run is not None:
        return hf_config_from_fields(_fields_from_run_config(run),
                                     os.path.join(folder, RUN_CONFIG_FILE), vocab_rows)
    args = read_megatron_lm_args(folder)
    if args is not None:
        return hf_config_from_fields(_fields_from_args(args),
                                     os.path.join(folder, COMMON_FILE) + " (args)", vocab_rows)
    raise CheckpointError(f"{folder}: no config.json, no {RUN_CONFIG_FILE} (Megatron-Bridge) and "
                          f"no Megatron-LM args in {COMMON_FILE}: the model's settings are "
                          "unknown; pass --hf-config DIR (a folder with the model's HF config.json)")
