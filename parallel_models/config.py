"""One validated model configuration built from an HF config.

Every registered family (``parallel_models.llama.families``: Llama, Qwen2, Qwen3, Qwen2-MoE,
Qwen3-MoE, Mixtral, Gemma) is read into the one ``ModelConfig``; what a family reads differently
(attention biases, q/k norm, MoE fields, layer options) its family object says. The defaults of
the newer fields mean "dense Llama".
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from parallel_models.errors import ConfigError  # noqa: F401  (defined without torch, re-exported)
from parallel_models.llama.families import family_of_model_type


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
    # Qwen3 / Qwen3-MoE: RMSNorm over head_dim on every q and k head, before rotary
    qk_norm: bool = False
    # Mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral); num_experts == 0 means a dense model.
    num_experts: int = 0
    moe_top_k: int = 0  # experts per token (HF num_experts_per_tok)
    moe_intermediate_size: int = 0  # each routed expert's SwiGLU width
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to one
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert; 0 = none
    shared_expert_gate: bool = False  # Qwen2-MoE: shared expert scaled by sigmoid(x @ gate)
    moe_layer_ids: tuple[int, ...] = ()  # global layer indices with an MoE MLP (others dense)
    router_aux_loss_coef: float = 0.0  # the HF config's load-balancing weight (the trainer's
    # switch decides whether it is used; the router always runs its softmax in fp32)
    # the gated MLP's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GELU-tanh, Gemma)
    hidden_act: str = "silu"
    # RMSNorm scales by (1 + w) computed in fp32 before the cast back (Gemma; megatron-core's
    # layernorm_zero_centered_gamma); False: w times the normalized input cast back (Llama)
    norm_unit_offset: bool = False
    # the embedding output times this, as a tensor of the hidden dtype (Gemma: sqrt(hidden))
    embedding_multiplier: float = 1.0
    hf_config: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layer_ids)

    def is_moe_layer(self, layer_id: int) -> bool:
        """True when global layer ``layer_id`` has the MoE MLP (else the dense SwiGLU MLP)."""
        return layer_id in self.moe_layer_ids

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
        family = family_of_model_type(model_type)  # an unknown one reads as Llama
        family.check_hf_config(hf_config)  # activation, sliding window, ...
        qkv_bias, o_bias = family.attention_biases(hf_config)
        act = get("hidden_act", "silu")
        # transformers >= 4.56 names it `dtype` (`torch_dtype` is a property that warns);
        # older configs store `torch_dtype` as a plain attribute
        dtype = get("dtype", None) or vars(hf_config).get("torch_dtype")
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
            o_bias=o_bias,
            mlp_bias=bool(get("mlp_bias", False)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            initializer_range=get("initializer_range", 0.02),
            torch_dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
            hf_config=hf_config,
            qk_norm=family.qk_norm,
            hidden_act="silu" if act == "swish" else act,
            **family.layer_fields(hf_config),
            **family.moe_fields(hf_config),
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
        if not self.moe_layer_ids:
            return
        if self.num_experts < 1:
            raise ConfigError(f"moe_layer_ids {list(self.moe_layer_ids)} given but num_experts is "
                              f"{self.num_experts}")
        if not 1 <= self.moe_top_k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.moe_top_k}) must be between 1 and "
                              f"num_experts ({self.num_experts})")
        if self.moe_intermediate_size < 1:
            raise ConfigError(f"moe_intermediate_size must be a positive integer, got "
                              f"{self.moe_intermediate_size!r}")
        if self.shared_expert_intermediate_size < 0:
            raise ConfigError(f"shared_expert_intermediate_size must be >= 0, got "
                              f"{self.shared_expert_intermediate_size!r}")
        bad = [i for i in self.moe_layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"moe_layer_ids {bad} are outside the {self.num_layers} layers")

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
        if self.intermediate_size % tp and len(self.moe_layer_ids) < self.num_layers:
            raise ConfigError(f"intermediate_size ({self.intermediate_size}) is not divisible by "
                              f"tensor_parallel_size ({tp})")
        if not self.moe_layer_ids:
            return
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(self, name) % tp:
                raise ConfigError(f"{name} ({getattr(self, name)}) is not divisible by "
                                  f"tensor_parallel_size ({tp}) (experts are split over TP ranks)")

    def check_expert_parallel(self, ep: int) -> None:
        """Raise a ConfigError naming the values if the experts cannot be split over ``ep`` ranks."""
        if ep < 1:
            raise ConfigError(f"expert_model_parallel_size must be >= 1, got {ep}")
        if ep == 1:
            return
        if not self.moe_layer_ids:
            raise ConfigError(f"expert_model_parallel_size={ep} but {self.architecture} has no "
                              "MoE layers (num_experts=0); use expert_model_parallel_size=1")
        if self.num_experts % ep:
            raise ConfigError(f"num_experts ({self.num_experts}) is not divisible by "
                              f"expert_model_parallel_size ({ep})")

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
