"""Qwen3 (``Qwen3ForCausalLM``): Llama with a per-head RMSNorm of q and k before rotary and an
explicit ``head_dim``. Megatron: ``qk_layernorm``."""

from __future__ import annotations

from parallel_models.llama.families.registry import Family, register_family


@register_family
class Qwen3(Family):
    name = "Qwen3"
    model_type = "qwen3"
    hf_config_class = "Qwen3Config"
    qk_norm = True
    megatron_priority = 5
    tiny = dict(vocab_size=253, intermediate_size=96, num_hidden_layers=2, head_dim=24,
                tie_word_embeddings=True, rope_theta=1000000.0)
    tiny_note = "qk-norm, head_dim 24 != 64/4, tied"

    def matches_megatron(self, fields: dict) -> bool:
        return not fields["num_moe_experts"] and bool(fields["qk_layernorm"])
