"""Gemma (``GemmaForCausalLM``, model_type ``gemma``): Llama's decoder with three layer options,
all generic ModelConfig fields this family switches on:
- RMSNorm scaling by ``(1 + w)`` in fp32 before the cast (``norm_unit_offset``; HF and
  megatron-core, ``layernorm_zero_centered_gamma``, store the same ``w``);
- a gated GELU-tanh MLP (``hidden_act="gelu_pytorch_tanh"``; megatron: ``fast_gelu`` with
  ``gated_linear_unit``);
- embeddings scaled by ``sqrt(hidden_size)`` cast to the hidden dtype (``embedding_multiplier``;
  megatron-core's GPTModel has no such setting: Megatron-Bridge's ``GemmaModelProvider`` adds it);
tied embeddings and an explicit ``head_dim`` as its HF config says. Megatron settings with
``layernorm_zero_centered_gamma`` (Megatron-LM: ``apply_layernorm_1p``) read back as Gemma."""

from __future__ import annotations

from parallel_models.llama.families.registry import Family, register_family


@register_family
class Gemma(Family):
    name = "Gemma"
    model_type = "gemma"
    hf_config_class = "GemmaConfig"
    hidden_acts = ("gelu_pytorch_tanh",)
    bridge_provider = "megatron.bridge.models.gemma.gemma_provider.GemmaModelProvider"
    megatron_priority = 4
    tiny = dict(vocab_size=255, intermediate_size=96, num_hidden_layers=2, head_dim=24,
                tie_word_embeddings=True, rope_theta=10000.0, hidden_act="gelu_pytorch_tanh")
    tiny_note = "(1 + w) norms, GELU-tanh MLP, scaled embeddings, head_dim 24, tied"

    def layer_fields(self, hf_config) -> dict:
        return dict(norm_unit_offset=True,
                    embedding_multiplier=float(getattr(hf_config, "hidden_size")) ** 0.5)

    def matches_megatron(self, fields: dict) -> bool:
        return not fields["num_moe_experts"] and bool(fields.get("layernorm_zero_centered_gamma"))

    def hf_kwargs_from_megatron(self, fields: dict) -> dict:
        return dict(attention_bias=bool(fields["add_bias_linear"]),
                    hidden_act="gelu_pytorch_tanh")
