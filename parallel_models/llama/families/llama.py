"""Llama (``LlamaForCausalLM``): the base decoder every other family varies. Its HF config's
``attention_bias`` puts a bias on q/k/v and o_proj (Megatron: ``add_bias_linear``)."""

from __future__ import annotations

from parallel_models.llama.families.registry import Family, register_family


@register_family
class Llama(Family):
    name = "Llama"
    model_type = "llama"
    hf_config_class = "LlamaConfig"
    megatron_priority = 0
    tiny = dict(vocab_size=257, intermediate_size=96, num_hidden_layers=2,
                tie_word_embeddings=False,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                rope_theta=10000.0)
    tiny_note = "GQA, llama3 rope"

    def matches_megatron(self, fields: dict) -> bool:
        return True  # the fallback: any dense RMSNorm / SwiGLU GPT

    def hf_kwargs_from_megatron(self, fields: dict) -> dict:
        bias = bool(fields["add_bias_linear"])
        return dict(attention_bias=bias, mlp_bias=bias)
