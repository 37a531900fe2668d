"""Load transformers models for the fsdp backend and shard them with FSDP2.

- :func:`load_causal_lm`: any ``AutoModelForCausalLM`` folder, fp32 master weights (dropout
  off: PPO's old log-probs and its updates must see the same function; the pad token's
  embedding row trains like the others, as in the megatron backend).
- :func:`load_value_model`: the critic, a :class:`ValueModel` (the family's
  ``AutoModelForSequenceClassification`` body + its ``score`` head, num_labels=1). A score
  head absent from the folder (a causal-LM folder) is drawn exactly like our megatron Value
  models' head (``heads.value_head.ValueHead.reset_parameters``: N(0, initializer_range) from a
  CPU generator seeded with ``trainer.seed``), so both backends start the critic alike.
- :func:`device_mesh` (1-D data-parallel shard mesh, or 2-D replicate x shard for HSDP) and
  :func:`shard_model`: ``fully_shard`` per decoder layer (the classes the model names in
  ``_no_split_modules``), then the root; ``MixedPrecisionPolicy(bf16 params, fp32 reduce)``
  for a bf16 / fp16 run; activation checkpointing per decoder layer (transformers' own).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from parallel_models.errors import ConfigError
from parallel_models.heads.value_head import ValueHead

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def compute_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _no_dropout(path: str) -> dict:
    """Config overrides that turn every dropout probability of ``path``'s config to 0."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return {k: 0.0 for k, v in config.to_dict().items()
            if isinstance(v, float) and ("dropout" in k or k.endswith("pdrop")) and v != 0.0}


def _attn_implementation() -> str:
    """flash-attention 2 on CUDA when installed (packed sequences as varlen), else SDPA (packed
    sequences through transformers' block-diagonal masks)."""
    if torch.cuda.is_available():
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def _train_pad_row(hf_model) -> None:
    """transformers builds the input embedding with ``padding_idx`` = the pad token, which
    zeroes that row's gradient; the megatron backend trains it like any row (a sampled pad token
    is an ordinary input there), so both backends take the same step."""
    emb = hf_model.get_input_embeddings()
    if getattr(emb, "padding_idx", None) is not None:
        emb.padding_idx = None


def load_causal_lm(path: str):
    """``AutoModelForCausalLM`` from ``path`` on the CPU in fp32 (clear error if unreadable)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=_attn_implementation(),
            **_no_dropout(path))
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"{path}: cannot load it as a transformers AutoModelForCausalLM "
                          f"({type(err).__name__}: {err})") from err
    _train_pad_row(model)
    return model


class ValueModel(torch.nn.Module):
    """A sequence-classification model used per token: ``values [batch, seq]`` from the body's
    last hidden states through ``score`` (hidden -> 1). ``.model`` is the HF model itself
    (``save_pretrained`` writes an ordinary sequence-classification folder)."""

    def __init__(self, hf_model):
        super().__init__()
        if not isinstance(getattr(hf_model, "score", None), torch.nn.Linear):
            raise ConfigError(f"{type(hf_model).__name__} has no linear 'score' head; the fsdp "
                              "critic needs a *ForSequenceClassification with one")
        self.model = hf_model
        self.config = hf_model.config

    def forward(self, input_ids, position_ids=None, attention_mask=None, **kwargs):
        body = getattr(self.model, self.model.base_model_prefix)
        hidden = body(input_ids=input_ids, position_ids=position_ids,
                      attention_mask=attention_mask, **kwargs).last_hidden_state
        return self.model.score(hidden).squeeze(-1).clone()  # not a view (FSDP2 output hooks)


def _safetensors_keys(path: str) -> set[str]:
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    keys: set[str] = set()
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                keys.update(f.keys())
    return keys


def load_value_model(path: str, seed: int = 0) -> ValueModel:
    """The critic from ``path`` (a causal-LM or sequence-classification folder)."""
    from transformers import AutoModelForSequenceClassification

    try:
        hf = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=torch.float32, attn_implementation=_attn_implementation(),
            **_no_dropout(path))
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"{path}: cannot load it as a transformers "
                          f"AutoModelForSequenceClassification for the fsdp critic "
                          f"({type(err).__name__}: {err})") from err
    _train_pad_row(hf)
    model = ValueModel(hf)
    if "score.weight" not in _safetensors_keys(path):  # a new head: our Value models' draw
        head = ValueHead(hf.config.hidden_size, sequence_parallel=False)
        head.reset_parameters(getattr(hf.config, "initializer_range", 0.02), seed=seed)
        with torch.no_grad():
            hf.score.weight.copy_(head.weight)
    return model


def device_mesh(replicate: int = 1):
    """The data-parallel mesh over every rank: ``("shard",)``, or ``("replicate", "shard")``
    with ``replicate`` groups (HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if replicate < 1 or world % replicate:
        raise ConfigError(f"parallel.fsdp_replicate_size={replicate} must divide the world size "
                          f"({world})")
    kind = compute_device().type
    if replicate == 1:
        return init_device_mesh(kind, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(kind, (replicate, world // replicate),
                            mesh_dim_names=("replicate", "shard"))


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers: modules of the classes the HF model names in ``_no_split_modules``."""
    hf = model.model if isinstance(model, ValueModel) else model
    names = set(getattr(hf, "_no_split_modules", None) or [])
    # (fully_shard swaps a module's class for an FSDP subclass: look along the MRO)
    layers = [m for m in hf.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise ConfigError(f"{type(hf).__name__}: cannot find its decoder layers "
                          f"(_no_split_modules={sorted(names)})")
    return layers


def shard_model(model, mesh, dtype: str = "float32", activation_checkpointing: bool = False,
                trainable: bool = True):
    """``fully_shard`` ``model`` in place (per decoder layer, then the root) on ``mesh``, moved to
    the compute device; returns it. A frozen model (``trainable=False``) gets no gradients."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype={dtype!r}: use one of {', '.join(DTYPES)}")
    param_dtype = DTYPES[dtype]
    policy = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
              if param_dtype != torch.float32 else MixedPrecisionPolicy())
    if not trainable:
        model.requires_grad_(False)
    if activation_checkpointing and trainable:
        hf = model.model if isinstance(model, ValueModel) else model
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train(trainable)  # dropout is off; train mode runs the checkpointing
    # fully_shard moves each unit's shard (and buffers) to the mesh's device
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
