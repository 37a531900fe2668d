"""One validated model configuration built from an HF config (Llama, Qwen2, ...)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from parallel_models.errors import ConfigError  # noqa: F401  (defined without torch, re-exported)


_SUPPORTED_ROPE = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# rope types whose frequencies depend on the longest position of the batch
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: Any, default: torch.dtype = torch.float32) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # HF rope parameters without rope_theta; None = plain RoPE
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    initializer_range: float = 0.02
    torch_dtype: str | None = None
    hf_config: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def rope_depends_on_length(self) -> bool:
        """True when the rotary frequencies change with the batch's longest position (dynamic
        NTK, longrope): such models cannot replay a fixed decode graph."""
        return self.rope_type in _LENGTH_DEPENDENT_ROPE

    @classmethod
    def from_hf(cls, hf_config) -> "ModelConfig":
        """Build from a transformers ``PretrainedConfig`` (or a path to an HF folder)."""
        if isinstance(hf_config, (str, os.PathLike)):
            hf_config = load_hf_config(hf_config)
        get = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
        archs = get("architectures") or []
        arch = archs[0] if archs else f"{type(hf_config).__name__.replace('Config', '')}ForCausalLM"
        act = get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ConfigError(f"hidden_act={act!r} is not supported (SwiGLU models use 'silu')")
        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        head_dim = get("head_dim") or hidden // heads
        # transformers >= 5 keeps rope settings in `rope_parameters`; older ones in
        # `rope_theta` + `rope_scaling`.
        rope_params = dict(get("rope_parameters") or {})
        rope_scaling = dict(get("rope_scaling") or {}) or None
        theta = rope_params.pop("rope_theta", None) or get("rope_theta", 10000.0)
        if rope_params and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        if rope_scaling is not None:
            rope_scaling.pop("rope_theta", None)
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rtype not in _SUPPORTED_ROPE:
                raise ConfigError(f"rope scaling type {rtype!r} is not supported; supported: "
                                  f"{list(_SUPPORTED_ROPE)}")
            if rtype == "default":
                rope_scaling = None
        model_type = get("model_type", "llama")
        attention_bias = bool(get("attention_bias", False))
        qkv_bias = attention_bias or model_type == "qwen2"
        dtype = get("dtype", None) or get("torch_dtype", None)
        cfg = cls(
            architecture=arch,
            model_type=model_type,
            hidden_size=hidden,
            num_layers=get("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=get("intermediate_size"),
            vocab_size=get("vocab_size"),
            max_position_embeddings=get("max_position_embeddings", 2048),
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            qkv_bias=qkv_bias,
            o_bias=attention_bias,
            mlp_bias=bool(get("mlp_bias", False)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            initializer_range=get("initializer_range", 0.02),
            torch_dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
            hf_config=hf_config,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) is not divisible "
                              f"by num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise a ConfigError naming the values if this model cannot be split over ``tp`` ranks."""
        if self.num_attention_heads % tp:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) is not divisible "
                              f"by tensor_parallel_size ({tp})")
        kv = self.num_key_value_heads
        if kv % tp and tp % kv:
            raise ConfigError(f"num_key_value_heads ({kv}) and tensor_parallel_size ({tp}): one "
                              "must divide the other (KV heads are split, or replicated when "
                              "there are fewer than TP ranks)")
        if self.intermediate_size % tp:
            raise ConfigError(f"intermediate_size ({self.intermediate_size}) is not divisible by "
                              f"tensor_parallel_size ({tp})")

    def padded_vocab_size(self, tp: int) -> int:
        """Vocab rows padded up to a multiple of TP; the padding never shows in outputs."""
        return -(-self.vocab_size // tp) * tp

    def kv_heads_per_rank(self, tp: int) -> int:
        return max(self.num_key_value_heads // tp, 1)

    def kv_head_index(self, tp: int, tp_rank: int) -> int:
        """First KV head of this rank (with replication, ranks of one group share a head)."""
        if self.num_key_value_heads >= tp:
            return tp_rank * self.num_key_value_heads // tp
        return tp_rank // (tp // self.num_key_value_heads)


def load_hf_config(path: str | os.PathLike):
    """Load a transformers config from a folder (or hub id) with a clear error when absent."""
    from transformers import AutoConfig

    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path}: no config.json (expected an HF model folder)")
    try:
        return AutoConfig.from_pretrained(path)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{os.path.join(path, 'config.json')}: not valid JSON ({err})") from err
