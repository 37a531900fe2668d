"""The megatron-core ``GPTModel`` dist-checkpoint format (``torch_dist``) around the DCP files:
where such a checkpoint is, its key names, the small files megatron-core adds, and the
``TransformerConfig`` / ``GPTModel`` arguments we write next to it (``mcore_config.json``) with a
builder of megatron-core's own ``GPTModel`` from them.

The format, as megatron-core 0.16 writes it (``dist_checkpointing.save``):
- ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``), ``common.pt`` (the non-sharded
  part of the state dict; empty for a ``GPTModel``; 0.19 writes none), ``.metadata`` (torch
  DCP's index) and ``__<rank>_<n>.distcp`` files holding the chunks (``torch.save`` records).
- keys as ``GPTModel.sharded_state_dict()`` names them; per-layer tensors stacked with a leading
  layer axis; ``_extra_state`` objects as ``<key>/shard_<layer>_<num_layers>``.
"""

from __future__ import annotations

import io
import json
import math
import os

import torch

from parallel_models.config import ConfigError, ModelConfig
from parallel_models.llama.checkpoint_utils.dcp import DCP_METADATA
from parallel_models.llama.checkpoint_utils.errors import CheckpointError
from parallel_models.llama.families import family_of_model_type
from parallel_models.llama.families.registry import GPT_PROVIDER

MCORE_CONFIG_FILE = "mcore_config.json"  # our JSON of TransformerConfig / GPTModel arguments
TRACKER_FILE = "latest_checkpointed_iteration.txt"  # Megatron-LM's tracker (Bridge writes it too)
MEGATRON_METADATA = "metadata.json"      # megatron-core's: backend and version
COMMON_FILE = "common.pt"
FORMAT = "parallel_models.mcore/1"

MCORE_LAYER_PREFIX = "decoder.layers."
# megatron-core's local spec maps its norms to the transformer-engine names when it saves
# (``sharded_state_dict_keys_map``); these are the module names a local spec without that map uses.
LOCAL_SPEC_NAMES = {
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": "decoder.layers.input_layernorm.weight",
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": "decoder.layers.pre_mlp_layernorm.weight",
}
# the key names of a layer spec (``WeightMapping.mcore_key``): transformer-engine's (Megatron-LM's
# and Bridge's default), megatron-core's local spec (with its keys map), a local spec without it
LAYER_SPECS = ("te", "mcore-local", "local")
# under the transformer-engine spec an MoE layer's pre-MLP norm is a module of its own
# (``pre_mlp_layernorm``, gpt_layer_specs.py: no fused linear_fc1 to hold it), saved by its name
TE_MOE_LAYER_NAMES = ("decoder.layers.mlp.linear_fc1.layer_norm_weight",)
# the linears of a layer: megatron-core saves an ``_extra_state`` object for each, and its default
# (strict) load asks for them
MCORE_EXTRA_STATE_KEYS = tuple(
    f"decoder.layers.{m}._extra_state" for m in
    ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"))


def is_mcore_checkpoint(path: str) -> bool:
    """A megatron-core dist checkpoint folder (or a Megatron-LM run folder pointing to one)."""
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, DCP_METADATA)):
        return True
    meta = os.path.join(path, MEGATRON_METADATA)
    if os.path.isfile(meta):
        try:
            with open(meta) as f:
                return "sharded_backend" in json.load(f)
        except (OSError, json.JSONDecodeError):
            return False
    return os.path.isfile(os.path.join(path, TRACKER_FILE))


def resolve_mcore_dir(path: str) -> str:
    """``path`` itself, or for a Megatron-LM run folder the iteration it names as latest."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such folder")
    tracker = os.path.join(path, TRACKER_FILE)
    if not os.path.isfile(os.path.join(path, MEGATRON_METADATA)) and os.path.isfile(tracker):
        with open(tracker) as f:
            it = f.read().strip()
        sub = os.path.join(path, "release" if it == "release" else f"iter_{int(it):07d}")
        if not os.path.isdir(sub):
            raise CheckpointError(f"{tracker} names iteration {it}, but {sub} is missing")
        return sub
    meta = os.path.join(path, MEGATRON_METADATA)
    if not os.path.isfile(meta):
        raise CheckpointError(f"{path}: no {MEGATRON_METADATA}; not a megatron-core dist checkpoint")
    try:
        with open(meta) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{meta}: not valid JSON ({err})") from err
    if backend != "torch_dist":
        raise CheckpointError(f"{path}: sharded_backend is {backend!r}; only 'torch_dist' "
                              "checkpoints are supported")
    return path


def layout_root(weights_dir: str) -> str | None:
    """The run folder of a Megatron-LM iteration folder (its parent, whose tracker names it), or
    None: our HF-side files (config.json, mcore_config.json, tokenizer) sit there."""
    parent = os.path.dirname(os.path.abspath(weights_dir))
    if not os.path.isfile(os.path.join(parent, TRACKER_FILE)):
        return None
    try:
        named = resolve_mcore_dir(parent)
    except (CheckpointError, OSError, ValueError):
        return None
    return parent if os.path.abspath(named) == os.path.abspath(weights_dir) else None


def side_file(weights_dir: str, name: str) -> str | None:
    """The file ``name`` next to a dist checkpoint: in its folder, else in the run folder of an
    iteration layout (:func:`layout_root`); None when neither has it."""
    for folder in (weights_dir, layout_root(weights_dir)):
        if folder is not None and os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return None


def read_mcore_json(folder: str) -> dict | None:
    path = side_file(folder, MCORE_CONFIG_FILE)
    if path is None:
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from err


def extra_state_objects(config: ModelConfig, layer: int) -> list[tuple[str, int, int]]:
    """The ``_extra_state`` objects of global layer ``layer`` as (key, index, count): one per
    linear, stacked over the layers for a dense model; for an MoE model (saved per layer) one per
    linear of the layer, the routed experts' stacked over the experts."""
    if not config.is_moe:
        return [(key, layer, config.num_layers) for key in MCORE_EXTRA_STATE_KEYS]
    prefix = f"{MCORE_LAYER_PREFIX}{layer}."
    out = [(prefix + f"self_attention.{m}._extra_state", 0, 1)
           for m in ("linear_qkv", "linear_proj")]
    if not config.is_moe_layer(layer):
        return out + [(prefix + f"mlp.{m}._extra_state", 0, 1) for m in ("linear_fc1", "linear_fc2")]
    out += [(prefix + f"mlp.experts.experts.{m}._extra_state", e, config.num_experts)
            for m in ("linear_fc1", "linear_fc2") for e in range(config.num_experts)]
    if config.shared_expert_intermediate_size:
        out += [(prefix + f"mlp.shared_experts.{m}._extra_state", 0, 1)
                for m in ("linear_fc1", "linear_fc2")]
    return out


def extra_state_items(num_layers: int, config: ModelConfig | None = None
                      ) -> list[tuple[str, bytes]]:
    """The ``_extra_state`` objects megatron-core saves for each linear of each layer (an MoE
    ``config``: its per-layer layout, :func:`extra_state_objects`). Local-spec linears have none
    (``None``); transformer-engine's accept ``None`` (no FP8 state) on load."""
    buf = io.BytesIO()
    torch.save([None], buf)  # what megatron-core writes for a ShardedObject holding None
    raw = buf.getvalue()
    if config is not None and config.is_moe:
        return [(f"{key}/shard_{i}_{n}", raw) for layer in range(config.num_layers)
                for key, i, n in extra_state_objects(config, layer)]
    return [(f"{key}/shard_{i}_{num_layers}", raw) for key in MCORE_EXTRA_STATE_KEYS
            for i in range(num_layers)]


def write_megatron_files(folder: str, common: dict | None = None) -> None:
    """What megatron-core's ``dist_checkpointing.save`` adds to the DCP files: ``common.pt`` (the
    common state: an empty dict for a bare GPTModel, Megatron-LM's args and iteration in its
    layouts; torch.save is the format megatron-core reads it with) and ``metadata.json``."""
    with open(os.path.join(folder, COMMON_FILE), "wb") as f:
        torch.save(common or {}, f)
        f.flush()
        os.fsync(f.fileno())
    with open(os.path.join(folder, MEGATRON_METADATA), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)
        f.flush()
        os.fsync(f.fileno())


# ModelConfig.hidden_act -> the name of megatron's function for it (mcore_config.json's
# activation_func; megatron.core.activations.fast_gelu is the tanh approximation of GELU)
MEGATRON_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "fast_gelu"}


def megatron_activation(name: str):
    """The function of an ``activation_func`` name of mcore_config.json."""
    if name == "silu":
        return torch.nn.functional.silu
    if name == "fast_gelu":
        from megatron.core.activations import fast_gelu

        return fast_gelu
    raise ConfigError(f"activation {name!r} is not supported; known: "
                      f"{', '.join(MEGATRON_ACTIVATIONS.values())}")


def check_megatron_compatible(config: ModelConfig) -> None:
    """Raise a ConfigError for models megatron-core's GPTModel cannot express."""
    if config.o_bias != config.mlp_bias or (config.o_bias and not config.qkv_bias):
        raise ConfigError(
            f"attention_bias={config.o_bias}, mlp_bias={config.mlp_bias}: megatron-core's "
            "add_bias_linear puts a bias on every linear (qkv, proj, fc1, fc2) and add_qkv_bias on "
            "qkv only; this combination has no GPTModel equivalent")
    if config.hidden_act not in MEGATRON_ACTIVATIONS:
        raise ConfigError(f"hidden_act={config.hidden_act!r} has no megatron-core activation here "
                          f"(known: {', '.join(MEGATRON_ACTIVATIONS)})")


# YaRN settings megatron-core's GPTModel reads from its config with getattr (not TransformerConfig
# fields in 0.16: build_gpt_model sets them on the config after construction)
YARN_ATTRIBUTES = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings",
                   "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim",
                   "yarn_correction_range_round_to_int")


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_args(config: ModelConfig, rs: dict) -> tuple[dict, list[str]]:
    """HF YaRN parameters -> megatron-core's ``yarn_*`` settings (HF's defaults where absent)."""
    factor = rs.get("factor")
    original = rs.get("original_max_position_embeddings") or config.max_position_embeddings
    if factor is None:  # transformers infers it the same way
        factor = config.max_position_embeddings / original
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    args = {"yarn_rotary_scaling_factor": float(factor),
            "yarn_original_max_position_embeddings": int(original),
            "yarn_beta_fast": float(rs.get("beta_fast") or 32),
            "yarn_beta_slow": float(rs.get("beta_slow") or 1),
            # megatron's concentration factor get_mscale(s, mscale) / get_mscale(s, all_dim) is
            # HF's attention_factor when both are set, and 0.1 ln(s) + 1 with (1, 0) otherwise
            "yarn_mscale": float(mscale) if mscale and mscale_all_dim else 1.0,
            "yarn_mscale_all_dim": float(mscale_all_dim) if mscale and mscale_all_dim else 0.0,
            "yarn_correction_range_round_to_int": bool(rs.get("truncate", True))}
    # megatron-core's attention scales cos/sin by that factor (config.yarn_* read by getattr),
    # as transformers does with its attention_scaling
    notes = []
    inferred = _yarn_mscale(factor, args["yarn_mscale"]) / _yarn_mscale(factor,
                                                                      args["yarn_mscale_all_dim"])
    given = rs.get("attention_factor")
    if given is not None and abs(float(given) - inferred) > 1e-9:
        notes.append(f"rope yarn attention_factor={given} (not the {inferred:.6g} its other "
                     "settings give) has no megatron-core setting; its attention will differ")
    if rs.get("partial_rotary_factor", 1.0) != 1.0:
        notes.append(f"rope yarn partial_rotary_factor={rs['partial_rotary_factor']}: not mapped")
    return args, notes


def _rope_args(config: ModelConfig) -> tuple[dict, dict, list[str]]:
    """(GPTModel rope arguments, TransformerConfig yarn_* settings, notes). Settings that are
    off are written as off: ``rope_scaling_factor`` 1.0 unless llama3 scaling is on."""
    notes = []
    args = {"rotary_base": config.rope_theta, "rotary_percent": 1.0, "rope_scaling": False,
            "rope_scaling_factor": 1.0, "seq_len_interpolation_factor": None,
            "position_embedding_type": "rope"}
    yarn: dict = {}
    rs = config.rope_scaling or {}
    kind = config.rope_type
    if kind == "llama3":
        args["rope_scaling"] = True
        args["rope_scaling_factor"] = float(rs.get("factor", 8.0))
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
        diff = {k: rs.get(k) for k, v in fixed.items() if float(rs.get(k, v)) != v}
        if diff:
            notes.append(f"rope llama3 with {diff}: megatron-core 0.16 fixes low_freq_factor=1, "
                         "high_freq_factor=4, original_max_position_embeddings=8192; its rotary "
                         "embedding will differ from the HF model's")
    elif kind == "linear":
        args["seq_len_interpolation_factor"] = float(rs["factor"])
    elif kind == "yarn":
        args["position_embedding_type"] = "yarn"
        yarn, yarn_notes = _yarn_args(config, rs)
        notes += yarn_notes
    elif kind != "default":
        notes.append(f"rope scaling {kind!r} has no megatron-core GPTModel equivalent; plain RoPE "
                     "is configured")
    return args, yarn, notes


def _moe_args(config: ModelConfig) -> dict:
    """The TransformerConfig MoE settings of an MoE model (``moe_layer_freq`` as a list: which
    layers are MoE; megatron-core then saves the layers one by one, as we do). The router runs in
    fp32 (``moe_router_dtype``), as transformers computes its softmax and as our MoE layer does:
    Bridge leaves it unset (the params dtype), on purpose we do not."""
    if not config.is_moe:
        return {}
    return {"num_moe_experts": config.num_experts, "moe_router_topk": config.moe_top_k,
            "moe_ffn_hidden_size": config.moe_intermediate_size,
            "moe_layer_freq": [1 if config.is_moe_layer(i) else 0
                               for i in range(config.num_layers)],
            "moe_router_pre_softmax": not config.norm_topk_prob,
            "moe_router_score_function": "softmax", "moe_router_dtype": "fp32",
            "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0,
            "moe_token_dispatcher_type": "alltoall",
            "moe_shared_expert_intermediate_size": config.shared_expert_intermediate_size or None,
            "moe_shared_expert_gate": bool(config.shared_expert_gate)}


def megatron_training_args(config: ModelConfig) -> dict:
    """The MoE training settings a Megatron user starts from, written into Bridge's
    ``run_config.yaml`` and Megatron-LM's ``args`` over ``transformer_config`` (which stays the
    portable GPTModel ``build_gpt_model`` makes: no grouped GEMM or fused permutation, which need
    transformer-engine, no auxiliary loss): the family's Bridge settings
    (``Family.megatron_moe_training``: load-balancing type, ``moe_grouped_gemm``,
    ``moe_permute_fusion``) and the HF config's ``router_aux_loss_coef`` as ``moe_aux_loss_coeff``.
    None of them changes a weight."""
    if not config.is_moe:
        return {}
    family = family_of_model_type(config.model_type)
    return {**family.megatron_moe_training,
            "moe_aux_loss_coeff": float(config.router_aux_loss_coef)}


def mcore_config_dict(config: ModelConfig, *, head_kind: str, dtype: torch.dtype,
                      layer_spec: str) -> dict:
    """The JSON written next to a dist checkpoint: megatron-core ``TransformerConfig`` and
    ``GPTModel`` arguments that reproduce the model (plus what is not expressible, in notes)."""
    check_megatron_compatible(config)
    family = family_of_model_type(config.model_type)
    rope, yarn, notes = _rope_args(config)
    dname = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    tc = {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "ffn_hidden_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_query_groups": config.num_key_value_heads,
        "kv_channels": config.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": config.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": MEGATRON_ACTIVATIONS[config.hidden_act],
        "add_bias_linear": bool(config.o_bias),
        "add_qkv_bias": bool(config.qkv_bias),
        "qk_layernorm": bool(config.qk_norm),  # per-head RMSNorm of q and k (kv_channels wide)
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "init_method_std": config.initializer_range,
        "params_dtype": dname,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        **yarn,
        **_moe_args(config),
    }
    if config.norm_unit_offset:  # megatron-core's RMSNorm then scales by (1 + w), as HF's Gemma
        tc["layernorm_zero_centered_gamma"] = True
    gpt = {
        "vocab_size": config.vocab_size,
        "max_sequence_length": config.max_position_embeddings,
        "share_embeddings_and_output_weights": bool(config.tie_word_embeddings
                                                    and head_kind == "causal_lm"),
        **rope,
    }
    if config.embedding_multiplier != 1.0:
        notes.append(f"embeddings are scaled by {config.embedding_multiplier!r}: not a "
                     "megatron-core GPTModel setting (Megatron-Bridge's provider "
                     f"{family.bridge_provider} applies it); a bare GPTModel's outputs differ")
    if head_kind == "value":
        notes.append("value model: output_layer.weight is [1, hidden] (the value head, as verl's "
                     "critic); build GPTModel with an output layer of size 1")
    out = {
        "format": FORMAT,
        "layer_spec": layer_spec,
        "value_head": head_kind == "value",
        "dtype": dname,
        "hf_architecture": config.architecture,
        "transformer_config": tc,
        "gpt_model": gpt,
        "megatron_training": megatron_training_args(config),
        "vocab_note": "the checkpoint holds the true vocab rows; megatron-core pads the vocab "
                      "(e.g. to a multiple of 128 x TP) and loads the stored rows into it",
        "notes": notes,
    }
    if family.bridge_provider != GPT_PROVIDER:  # a family with its own Bridge provider class
        out["bridge_provider"] = family.bridge_provider
    return out


# settings of mcore_config.json that must agree with the HF config a checkpoint is read with
_CHECKED = {"transformer_config": ("num_layers", "hidden_size", "ffn_hidden_size",
                                   "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
                                   "moe_layer_freq", "moe_shared_expert_intermediate_size",
                                   "num_attention_heads", "num_query_groups", "kv_channels",
                                   "qk_layernorm", "add_qkv_bias", "add_bias_linear",
                                   "activation_func", "layernorm_zero_centered_gamma",
                                   *YARN_ATTRIBUTES),
            "gpt_model": ("vocab_size", "position_embedding_type", "rotary_base", "rope_scaling",
                          "seq_len_interpolation_factor")}


def check_mcore_json(info: dict, config: ModelConfig, folder: str) -> None:
    """Raise a CheckpointError naming the setting when the ``mcore_config.json`` of ``folder``
    (``info``; may be empty: megatron's own saves have none) disagrees with ``config``, the HF
    config the checkpoint is read with (e.g. qk_layernorm, kv_channels, YaRN settings). Settings
    absent from either side are not compared (older files lack some)."""
    if not info:
        return
    try:
        want = mcore_config_dict(config, head_kind="causal_lm", dtype=torch.float32,
                                 layer_spec="te")
    except ConfigError:
        return  # not expressible in megatron-core: nothing to compare against
    for section, keys in _CHECKED.items():
        got_section = info.get(section) or {}
        for key in keys:
            if key in got_section and key in want[section] and got_section[key] != want[section][key]:
                raise CheckpointError(
                    f"{side_file(folder, MCORE_CONFIG_FILE)}: {section}.{key} is "
                    f"{got_section[key]!r} but the HF config ({config.architecture}) gives "
                    f"{want[section][key]!r}; pass the HF config of this checkpoint")
    got_rope = info.get("gpt_model") or {}
    if got_rope.get("rope_scaling") and want["gpt_model"]["rope_scaling"]:
        got, exp = got_rope.get("rope_scaling_factor"), want["gpt_model"]["rope_scaling_factor"]
        if got != exp:
            raise CheckpointError(f"{side_file(folder, MCORE_CONFIG_FILE)}: "
                                  f"gpt_model.rope_scaling_factor is {got!r} but the HF config "
                                  f"gives {exp!r}")


def build_gpt_model(mcore_json: dict | str, *, layer_spec="local",
                    vocab_multiple: int = 128, pre_process: bool = True,
                    post_process: bool = True, **overrides):
    """A megatron-core ``GPTModel`` for this rank from the JSON :func:`mcore_config_dict` writes
    (a dict, or a checkpoint folder / JSON path). The vocab is padded to a multiple of
    ``vocab_multiple`` x TP like Megatron-LM does. Call after ``init_parallel``; on the CPU wrap
    it in ``cpu_shim.cuda_to_cpu()``."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    if isinstance(mcore_json, str):
        path = (side_file(resolve_mcore_dir(mcore_json), MCORE_CONFIG_FILE)
                or os.path.join(mcore_json, MCORE_CONFIG_FILE)
                if os.path.isdir(mcore_json) else mcore_json)
        with open(path) as f:
            mcore_json = json.load(f)
    tc = dict(mcore_json["transformer_config"])
    tc["activation_func"] = megatron_activation(tc.pop("activation_func"))
    tc["params_dtype"] = getattr(torch, tc["params_dtype"])
    tp = mpu.get_tensor_model_parallel_world_size()
    tc.update(tensor_model_parallel_size=tp,
              pipeline_model_parallel_size=mpu.get_pipeline_model_parallel_world_size(),
              use_cpu_initialization=not torch.cuda.is_available(),
              bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
              apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)
    tc.update(overrides.pop("transformer_config", {}))
    yarn = {k: tc.pop(k) for k in YARN_ATTRIBUTES if k in tc}
    config = TransformerConfig(**tc)
    for key, value in yarn.items():  # read by GPTModel with getattr (position_embedding_type yarn)
        setattr(config, key, value)
    qk_layernorm = bool(tc.get("qk_layernorm", False))
    if tc.get("num_moe_experts") and layer_spec in ("local", "te"):
        # MoE: a block spec (dense and MoE layers as moe_layer_freq says)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        from parallel_models import megatron_fixes

        megatron_fixes.apply()

        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=layer_spec == "te",
                                          normalization="RMSNorm")  # qk_layernorm: from config
    elif layer_spec == "local":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    elif layer_spec == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    elif isinstance(layer_spec, str):
        raise ValueError(f"layer_spec must be 'local', 'te' or a ModuleSpec, got {layer_spec!r}")
    else:
        spec = layer_spec
    g = dict(mcore_json["gpt_model"])
    multiple = vocab_multiple * tp
    g["vocab_size"] = -(-g["vocab_size"] // multiple) * multiple
    g.update(overrides)
    return GPTModel(config=config, transformer_layer_spec=spec, pre_process=pre_process,
                    post_process=post_process, **g)
