"""What makes one model family differ from another, declared once per family, and the registry
of the families.

A family (``llama.py``, ``qwen2.py``, ... next to this file) is a :class:`Family` subclass marked
``@register_family``. Its class attributes and hooks say everything the generic code asks about
it: the HF ``model_type`` and class-name prefix (which give the architecture strings and the
``{Prefix}For{CausalLM|Value}[RmPad][PP]`` classes), how ``ModelConfig.from_hf`` reads its HF
config (attention biases, q/k norm, MoE fields, layer options such as Gemma's norm offset), its
HF names for the MoE tensors, how to recognise it among Megatron-LM / Bridge settings and what
those settings need (the Bridge provider class), and its tiny test config. The defaults of the
base class are the Llama ones. Nothing here imports the model, config or checkpoint code: they
ask this registry.
"""

from __future__ import annotations

from parallel_models.errors import ConfigError

GPT_PROVIDER = "megatron.bridge.models.gpt_provider.GPTModelProvider"

_FAMILIES: dict[str, "Family"] = {}  # class-name prefix -> family, in registration order


class Family:
    """One model family. Subclasses set the class attributes and override the hooks that differ
    from Llama's."""

    name: str = ""  # class-name prefix: "Llama", "Qwen3Moe" (-> Qwen3MoeForCausalLMRmPad)
    model_type: str = ""  # the HF config's model_type
    hf_config_class: str = ""  # the transformers config class (the tiny test configs use it)
    hidden_acts: tuple[str, ...] = ("silu", "swish")  # HF hidden_act values the MLP accepts
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3)
    sliding_window_on_every_layer: bool = False  # a set `sliding_window` applies everywhere
    # MoE families: (HF module of the MoE block, its experts' gate / up / down projection names)
    moe_hf_names: tuple[str, tuple[str, str, str]] | None = None
    bridge_provider: str = GPT_PROVIDER  # Megatron-Bridge's model provider class
    megatron_priority: int = 0  # which matching family wins when reading Megatron settings
    # MoE families: the training settings Megatron-Bridge's provider for the family sets (beyond
    # the weights: load balancing, grouped GEMM, fused permutation), written into Bridge's
    # run_config.yaml and Megatron-LM's args; moe_aux_loss_coeff comes from the HF config
    megatron_moe_training: dict = {}
    tiny: dict = {}  # the tiny test model's settings (testing.tiny_hf_config)
    tiny_note: str = ""  # what the tiny model exercises

    @property
    def architectures(self) -> tuple[str, ...]:
        """The HF ``architectures`` strings this family serves (reward models included)."""
        return (f"{self.name}ForCausalLM", f"{self.name}ForSequenceClassification",
                f"{self.name}Model")

    # -- reading the HF config (ModelConfig.from_hf) ---------------------------------------------
    def attention_biases(self, hf_config) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj)."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias

    def moe_fields(self, hf_config) -> dict:
        """The MoE fields of ModelConfig ({} for a dense family)."""
        return {}

    def layer_fields(self, hf_config) -> dict:
        """ModelConfig's layer options (norm offset, embedding multiplier) for this family."""
        return {}

    def check_hf_config(self, hf_config) -> None:
        """Raise a ConfigError for settings of this family that are not implemented."""
        model_type = getattr(hf_config, "model_type", None) or self.model_type
        layer_types = getattr(hf_config, "layer_types", None) or []
        window = getattr(hf_config, "sliding_window", None)
        sliding = "sliding_attention" in layer_types or bool(
            self.sliding_window_on_every_layer and window)
        if sliding:
            raise ConfigError(
                f"{model_type}: sliding-window attention (sliding_window={window}, "
                f"use_sliding_window={getattr(hf_config, 'use_sliding_window', None)}) is not "
                "supported; only full causal attention is")
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in self.hidden_acts:
            raise ConfigError(f"{model_type}: hidden_act={act!r} is not supported (this "
                              f"family's MLP uses {' / '.join(map(repr, self.hidden_acts))})")

    # -- Megatron-LM / Megatron-Bridge settings (megatron_hf_config) -----------------------------
    def matches_megatron(self, fields: dict) -> bool:
        """Whether megatron settings ``fields`` (TransformerConfig names) describe this family;
        of the matching families the one with the highest ``megatron_priority`` is taken."""
        return False

    def hf_kwargs_from_megatron(self, fields: dict) -> dict:
        """This family's HF config arguments beyond the common ones, from megatron settings."""
        return {}


def register_family(cls: type[Family]) -> type[Family]:
    """Class decorator: register one instance of the family (names must be unique)."""
    family = cls()
    for other in _FAMILIES.values():
        if family.model_type == other.model_type or family.name == other.name:
            raise ValueError(f"family {cls.__name__}: model_type {family.model_type!r} / name "
                             f"{family.name!r} already registered by {type(other).__name__}")
    _FAMILIES[family.name] = family
    return cls


def all_families() -> tuple[Family, ...]:
    return tuple(_FAMILIES.values())


def family_named(name: str) -> Family:
    """The family with class-name prefix ``name`` (e.g. "Qwen3Moe")."""
    if name not in _FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; known: {', '.join(_FAMILIES)}")
    return _FAMILIES[name]


def family_of_model_type(model_type: str, default: str | None = "Llama") -> Family:
    """The family of an HF ``model_type``; an unknown one reads as the ``default`` family
    (Llama-style: the registry refuses its architecture later), or a ConfigError without one."""
    for family in _FAMILIES.values():
        if family.model_type == model_type:
            return family
    if default is None:
        known = ", ".join(f.model_type for f in _FAMILIES.values())
        raise ConfigError(f"unknown model_type {model_type!r}; known: {known}")
    return _FAMILIES[default]


def family_from_megatron(fields: dict) -> Family:
    """The family megatron settings describe (the highest-priority match)."""
    matching = [f for f in _FAMILIES.values() if f.matches_megatron(fields)]
    if not matching:
        raise ConfigError("these Megatron settings match no registered model family")
    return max(matching, key=lambda f: f.megatron_priority)

