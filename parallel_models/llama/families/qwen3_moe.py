"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k norm) with routed experts on the
layers ``decoder_sparse_step`` / ``mlp_only_layers`` choose; a set ``sliding_window`` applies to
every layer (refused). Megatron: experts with ``qk_layernorm``."""

from __future__ import annotations

from parallel_models.llama.families.moe import (QWEN_MOE_HF_NAMES, qwen_moe_fields,
                                                qwen_moe_hf_kwargs)
from parallel_models.llama.families.registry import Family, register_family


@register_family
class Qwen3Moe(Family):
    name = "Qwen3Moe"
    model_type = "qwen3_moe"
    hf_config_class = "Qwen3MoeConfig"
    qk_norm = True
    sliding_window_on_every_layer = True
    moe_hf_names = QWEN_MOE_HF_NAMES
    # as Bridge's Qwen3MoEBridge.provider_bridge sets them (its coefficient, a fixed 1e-3, is
    # Qwen3-MoE's HF default router_aux_loss_coef: ours comes from the HF config)
    megatron_moe_training = dict(moe_router_load_balancing_type="aux_loss", moe_grouped_gemm=True,
                                 moe_permute_fusion=True)
    megatron_priority = 30
    tiny = dict(vocab_size=253, intermediate_size=96, num_hidden_layers=3, head_dim=24,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                tie_word_embeddings=False, rope_theta=1000000.0)
    tiny_note = "4 experts top-2, layer 1 dense"

    def moe_fields(self, hf_config) -> dict:
        return qwen_moe_fields(hf_config, self.model_type, shared_expert=False)

    def matches_megatron(self, fields: dict) -> bool:
        return bool(fields["num_moe_experts"]) and bool(fields["qk_layernorm"])

    def hf_kwargs_from_megatron(self, fields: dict) -> dict:
        return qwen_moe_hf_kwargs(fields)
