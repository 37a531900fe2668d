"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (its own ``qkv_bias`` switch, no o_proj
bias) with routed experts plus an always-on shared expert scaled by a sigmoid gate. Megatron:
experts with ``moe_shared_expert_intermediate_size``."""

from __future__ import annotations

from parallel_models.llama.families.moe import (QWEN_MOE_HF_NAMES, qwen_moe_fields,
                                                qwen_moe_hf_kwargs)
from parallel_models.llama.families.registry import Family, register_family


@register_family
class Qwen2Moe(Family):
    name = "Qwen2Moe"
    model_type = "qwen2_moe"
    hf_config_class = "Qwen2MoeConfig"
    moe_hf_names = QWEN_MOE_HF_NAMES
    # the Qwen MoE settings of Bridge's Qwen3MoEBridge.provider_bridge (see qwen3_moe.py; the
    # coefficient comes from the HF config)
    megatron_moe_training = dict(moe_router_load_balancing_type="aux_loss", moe_grouped_gemm=True,
                                 moe_permute_fusion=True)
    megatron_priority = 20
    tiny = dict(vocab_size=251, intermediate_size=96, num_hidden_layers=3, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=1,
                mlp_only_layers=[1], tie_word_embeddings=False, rope_theta=1000000.0)
    tiny_note = "4 experts top-2 + gated shared expert, layer 1 dense"

    def attention_biases(self, hf_config) -> tuple[bool, bool]:
        return bool(getattr(hf_config, "qkv_bias", True)), False

    def moe_fields(self, hf_config) -> dict:
        return qwen_moe_fields(hf_config, self.model_type, shared_expert=True)

    def matches_megatron(self, fields: dict) -> bool:
        return bool(fields["num_moe_experts"]) and bool(
            fields["moe_shared_expert_intermediate_size"])

    def hf_kwargs_from_megatron(self, fields: dict) -> dict:
        return dict(qwen_moe_hf_kwargs(fields),
                    shared_expert_intermediate_size=fields["moe_shared_expert_intermediate_size"])
