"""Qwen2 (``Qwen2ForCausalLM``): Llama with a bias on q/k/v (never on o_proj), usually tied
embeddings. Megatron: ``add_qkv_bias`` without ``add_bias_linear``."""

from __future__ import annotations

from parallel_models.llama.families.registry import Family, register_family


@register_family
class Qwen2(Family):
    name = "Qwen2"
    model_type = "qwen2"
    hf_config_class = "Qwen2Config"
    megatron_priority = 1
    tiny = dict(vocab_size=251, intermediate_size=96, num_hidden_layers=2,
                tie_word_embeddings=True, rope_theta=1000000.0)
    tiny_note = "qkv bias, tied"

    def attention_biases(self, hf_config) -> tuple[bool, bool]:
        return True, False

    def matches_megatron(self, fields: dict) -> bool:
        return (not fields["num_moe_experts"] and bool(fields["add_qkv_bias"])
                and not fields["add_bias_linear"])
