"""The folder layouts Megatron-LM and Megatron-Bridge save a model in, around a dist checkpoint.

- ``flat``: the dist checkpoint files in the folder itself (megatron-core's
  ``dist_checkpointing.save`` output; ``common.pt`` holds an empty dict).
- ``megatron-lm``: Megatron-LM's iteration layout (``megatron/training/checkpointing.py``):
  ``latest_checkpointed_iteration.txt`` (the iteration number) and ``iter_0000000/`` holding the
  dist checkpoint, whose common state (``common.pt``) carries ``args`` (an ``argparse.Namespace``
  with Megatron-LM's argument names for the architecture, parallel sizes 1), ``checkpoint_version``
  3.0 and ``iteration``, as Megatron-LM's ``generate_state_dict`` writes them.
- ``bridge``: the same plus ``iter_0000000/run_config.yaml``, a Megatron-Bridge ``ConfigContainer``
  (``model``: a ``GPTModelProvider`` with its fields, ``tokenizer``, ``checkpoint``) as
  Bridge's ``save_megatron_model`` writes it; Bridge's ``load_megatron_model`` reads the model from
  it, Megatron-LM the args. The default: both tools open it as it is.

Our own files (``config.json``, ``mcore_config.json``, tokenizer files) sit in the output folder:
next to the dist checkpoint (flat), or beside the tracker (iteration layouts), so the folder is
still an HF-style model folder for tokenizers and configs while ``iter_0000000/`` holds exactly
what Megatron-LM / Bridge write. Reading: ``common.pt`` is a pickle, read
with ``torch.load(weights_only=True)`` allowing ``argparse.Namespace`` only; the YAML with
``yaml.safe_load``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle

import torch

from parallel_models.config import ConfigError
from parallel_models.llama.checkpoint_utils.errors import CheckpointError
from parallel_models.llama.checkpoint_utils.megatron_format import (COMMON_FILE, TRACKER_FILE,
                                                                   YARN_ATTRIBUTES)
from parallel_models.llama.families.registry import GPT_PROVIDER

FORMATS = ("flat", "megatron-lm", "bridge")
DEFAULT_FORMAT = "bridge"  # Megatron-LM reads its args, Bridge its run_config.yaml
RUN_CONFIG_FILE = "run_config.yaml"  # Megatron-Bridge's ConfigContainer
CHECKPOINT_VERSION = 3.0  # what Megatron-LM and Bridge write into the common state
TOKENIZER_CONFIG = "megatron.bridge.training.tokenizers.config.TokenizerConfig"
CHECKPOINT_CONFIG = "megatron.bridge.training.config.CheckpointConfig"
# mcore_config.json's activation_func -> the function Bridge's run config names
_ACTIVATION_TARGETS = {"silu": "torch.nn.functional.silu",
                       "fast_gelu": "megatron.core.activations.fast_gelu"}


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")


def iteration_dir_name(iteration: int) -> str:
    """Megatron-LM's name of an iteration's folder (``get_checkpoint_name``)."""
    return f"iter_{iteration:07d}"


def weights_dir(root: str, fmt: str, iteration: int = 0) -> str:
    """Where the dist checkpoint files go for ``fmt`` under the output folder ``root``."""
    check_format(fmt)
    return root if fmt == "flat" else os.path.join(root, iteration_dir_name(iteration))


def tokenizer_source(given: str | None) -> str | None:
    """What the run config / args name as the tokenizer: the HF folder (absolute) the weights
    came from, or the hub id it was given as; None when unknown."""
    if not given:
        return None
    return os.path.abspath(given) if os.path.isdir(given) else given


def _dtype_name(info: dict) -> str:
    return info["transformer_config"]["params_dtype"]


# Megatron-LM arguments read without a default, with their Megatron-LM default values, that the
# architecture does not set: by Megatron-LM's ``load_checkpoint`` / ``check_checkpoint_args``
# (megatron/training/checkpointing.py) and by Megatron-Bridge's Megatron-LM compatibility path
# (``mlm_compat/arguments.py::_transformer_config_from_args``, ``mlm_compat/model.py::
# _gpt_provider``), which reads e.g. ``args.multi_latent_attention`` unconditionally.
MEGATRON_LM_DEFAULTS = dict(
    multi_latent_attention=False, heterogeneous_layers_config_path=None,
    heterogeneous_layers_config_encoded_json=None, no_persist_layer_norm=False,
    overlap_p2p_comm=False, decoder_first_pipeline_num_layers=None,
    decoder_last_pipeline_num_layers=None, fp8_param_gather=False, bias_swiglu_fusion=True,
    bias_gelu_fusion=True, init_method_xavier_uniform=False, config_logger_dir="",
    cp_comm_type=["p2p"], is_hybrid_model=False, qk_l2_norm=False, mtp_num_layers=None,
    fp16_lm_cross_entropy=False, init_model_with_meta_device=False, add_position_embedding=True,
    data_parallel_random_init=False, consumed_valid_samples=0, skipped_train_samples=0,
    spec=None, moe_grouped_gemm=False, experimental_attention_variant=None)


def megatron_lm_args(info: dict, tokenizer: str | None = None) -> argparse.Namespace:
    """The architecture as Megatron-LM's arguments (the names ``load_args_from_checkpoint`` and
    ``core_transformer_config_from_args`` read, Bridge's ``mlm_compat`` too), from the
    ``mcore_config_dict`` ``info``; parallel sizes 1 (the checkpoint loads at any);
    ``transformer_impl`` the spec whose key names were written; ``no_save_optim`` /
    ``no_save_rng``: the checkpoint holds neither, so Megatron-LM's ``load_checkpoint`` loads
    the model alone; the other arguments Megatron-LM's defaults (``MEGATRON_LM_DEFAULTS``)."""
    tc, gpt = info["transformer_config"], info["gpt_model"]
    dtype = _dtype_name(info)
    args = dict(MEGATRON_LM_DEFAULTS)
    args.update(
        num_layers=tc["num_layers"], hidden_size=tc["hidden_size"],
        ffn_hidden_size=tc["ffn_hidden_size"], num_attention_heads=tc["num_attention_heads"],
        group_query_attention=tc["num_query_groups"] != tc["num_attention_heads"],
        num_query_groups=tc["num_query_groups"], kv_channels=tc["kv_channels"],
        max_position_embeddings=gpt["max_sequence_length"], seq_length=gpt["max_sequence_length"],
        position_embedding_type=gpt["position_embedding_type"],
        use_rotary_position_embeddings=True, rotary_base=gpt["rotary_base"],
        rotary_percent=gpt["rotary_percent"], rotary_interleaved=False,
        rotary_seq_len_interpolation_factor=gpt["seq_len_interpolation_factor"],
        use_rope_scaling=gpt["rope_scaling"], rope_scaling_factor=gpt["rope_scaling_factor"],
        add_bias_linear=tc["add_bias_linear"], add_qkv_bias=tc["add_qkv_bias"],
        qk_layernorm=tc["qk_layernorm"], swiglu=tc["activation_func"] == "silu",
        openai_gelu=tc["activation_func"] == "fast_gelu", gated_linear_unit=True,
        squared_relu=False,
        untie_embeddings_and_output_weights=not gpt["share_embeddings_and_output_weights"],
        normalization="RMSNorm", norm_epsilon=tc["layernorm_epsilon"],
        apply_layernorm_1p=bool(tc.get("layernorm_zero_centered_gamma", False)),
        apply_query_key_layer_scaling=False, attention_dropout=0.0, hidden_dropout=0.0,
        init_method_std=tc["init_method_std"],
        vocab_size=gpt["vocab_size"], padded_vocab_size=gpt["vocab_size"],
        make_vocab_size_divisible_by=128,
        tokenizer_type="HuggingFaceTokenizer" if tokenizer else None, tokenizer_model=tokenizer,
        params_dtype=getattr(torch, dtype), bf16=dtype == "bfloat16", fp16=dtype == "float16",
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, context_parallel_size=1,
        expert_model_parallel_size=1, expert_tensor_parallel_size=1,
        sequence_parallel=False, use_dist_ckpt=True, ckpt_format="torch_dist",
        transformer_impl="transformer_engine" if info.get("layer_spec", "te") == "te" else "local",
        no_save_optim=True, no_save_rng=True,
        num_experts=tc.get("num_moe_experts"), iteration=0, consumed_train_samples=0)
    for key in YARN_ATTRIBUTES:
        if key in tc:
            args[key] = tc[key]
    if tc.get("num_moe_experts"):
        args.update(moe_router_topk=tc["moe_router_topk"],
                    moe_ffn_hidden_size=tc["moe_ffn_hidden_size"],
                    moe_layer_freq=list(tc["moe_layer_freq"]),
                    moe_router_pre_softmax=tc["moe_router_pre_softmax"],
                    moe_router_score_function=tc["moe_router_score_function"],
                    moe_router_dtype=tc.get("moe_router_dtype"),
                    moe_shared_expert_intermediate_size=tc["moe_shared_expert_intermediate_size"],
                    moe_shared_expert_gate=tc["moe_shared_expert_gate"],
                    moe_token_dispatcher_type=tc["moe_token_dispatcher_type"],
                    moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
                    moe_permute_fusion=False)
        args.update(info.get("megatron_training") or {})  # Bridge's settings for the family
    return argparse.Namespace(**args)


def bridge_run_config(info: dict, tokenizer: str | None = None) -> dict:
    """Megatron-Bridge's ``run_config.yaml`` content (its ``ConfigContainer`` as ``to_yaml``
    writes it: objects as ``_target_``; functions and dtypes with ``_call_: false``) for the
    ``mcore_config_dict`` ``info``: a ``GPTModelProvider`` that builds the same ``GPTModel``."""
    tc, gpt = dict(info["transformer_config"]), info["gpt_model"]
    dtype = tc.pop("params_dtype")
    act = tc.pop("activation_func")
    model = {"_target_": info.get("bridge_provider", GPT_PROVIDER), **tc,
             **(info.get("megatron_training") or {}),
             "activation_func": {"_target_": _ACTIVATION_TARGETS[act], "_call_": False},
             "params_dtype": {"_target_": f"torch.{dtype}", "_call_": False},
             "vocab_size": gpt["vocab_size"], "should_pad_vocab": False,
             "make_vocab_size_divisible_by": 128, "seq_length": gpt["max_sequence_length"],
             "share_embeddings_and_output_weights": gpt["share_embeddings_and_output_weights"],
             "position_embedding_type": gpt["position_embedding_type"],
             "rotary_base": gpt["rotary_base"], "rotary_percent": gpt["rotary_percent"],
             "rope_scaling": gpt["rope_scaling"], "rope_scaling_factor": gpt["rope_scaling_factor"],
             "seq_len_interpolation_factor": gpt["seq_len_interpolation_factor"],
             "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
             "context_parallel_size": 1, "expert_model_parallel_size": 1,
             "expert_tensor_parallel_size": 1, "sequence_parallel": False}
    tok = {"_target_": TOKENIZER_CONFIG,
           "tokenizer_type": "HuggingFaceTokenizer" if tokenizer else None,
           "tokenizer_model": tokenizer}
    ckpt = {"_target_": CHECKPOINT_CONFIG, "ckpt_format": "torch_dist", "save_optim": False,
            "save_rng": False, "async_save": False}
    return {"model": model, "tokenizer": tok, "checkpoint": ckpt}


def common_state(info: dict, fmt: str, tokenizer: str | None = None,
                 iteration: int = 0) -> dict:
    """The common (non-sharded) state saved with the weights for ``fmt``."""
    check_format(fmt)
    if fmt == "flat":
        return {}
    return {"args": megatron_lm_args(info, tokenizer), "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration}


def write_layout_files(root: str, fmt: str, info: dict, tokenizer: str | None = None,
                       iteration: int = 0) -> None:
    """The files of ``fmt`` beside the dist checkpoint (which is in ``weights_dir(root, fmt)``):
    the tracker and, for ``bridge``, ``run_config.yaml``."""
    import yaml

    check_format(fmt)
    if fmt == "flat":
        return
    with open(os.path.join(root, TRACKER_FILE), "w") as f:
        f.write(str(iteration))
    if fmt == "bridge":
        with open(os.path.join(weights_dir(root, fmt, iteration), RUN_CONFIG_FILE), "w") as f:
            yaml.safe_dump(bridge_run_config(info, tokenizer), f, sort_keys=False)


# -- reading ---------------------------------------------------------------------------------------
def read_common_state(folder: str) -> dict:
    """``common.pt`` of the dist checkpoint in ``folder`` ({} when absent: megatron-core 0.19 writes
    none for an empty one), unpickled by torch's weights-only loader with ``argparse.Namespace``
    (Megatron-LM's args) as the one class allowed beyond tensors and plain values."""
    path = os.path.join(folder, COMMON_FILE)
    if not os.path.isfile(path):
        return {}
    # torch's safe_globals context REMOVES its classes on exit, even ones registered before it
    # (megatron-core registers Namespace at import): only add Namespace when it is not there yet
    registered = argparse.Namespace in torch.serialization.get_safe_globals()
    allow = contextlib.nullcontext() if registered else torch.serialization.safe_globals(
        [argparse.Namespace])
    try:
        with allow:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path}: refused to unpickle it (it holds objects other than "
                              f"tensors, plain values and argparse.Namespace: {err})") from err
    except Exception as err:  # noqa: BLE001 - a corrupt or foreign file
        raise CheckpointError(f"{path}: cannot read the common state "
                              f"({type(err).__name__}: {err})") from err
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a dict")
    return state


def read_megatron_lm_args(folder: str) -> argparse.Namespace | None:
    """Megatron-LM's ``args`` in the common state of ``folder``, or None."""
    args = read_common_state(folder).get("args")
    if args is not None and not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{os.path.join(folder, COMMON_FILE)}: 'args' is a "
                              f"{type(args).__name__}, not an argparse.Namespace")
    return args


def read_run_config(folder: str) -> dict | None:
    """Megatron-Bridge's ``run_config.yaml`` of ``folder`` (safe YAML), or None."""
    import yaml

    path = os.path.join(folder, RUN_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as err:
        raise CheckpointError(f"{path}: not valid YAML ({err})") from err
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise CheckpointError(f"{path}: has no 'model' section (not a Megatron-Bridge run config)")
    return data
