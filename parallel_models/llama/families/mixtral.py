"""Mixtral (``MixtralForCausalLM``): Llama attention with routed experts on every layer
(``num_local_experts``; each expert as wide as ``intermediate_size``), top-k renormalised, HF
names ``block_sparse_moe.experts.{e}.w1/w3/w2``; a set ``sliding_window`` applies everywhere
(refused), router jitter is refused. Megatron: experts without q/k norm or shared expert."""

from __future__ import annotations

from parallel_models.errors import ConfigError
from parallel_models.llama.families.moe import common_moe_hf_kwargs, moe_layer_flags
from parallel_models.llama.families.registry import Family, register_family


@register_family
class Mixtral(Family):
    name = "Mixtral"
    model_type = "mixtral"
    hf_config_class = "MixtralConfig"
    sliding_window_on_every_layer = True
    moe_hf_names = ("block_sparse_moe", ("w1", "w3", "w2"))
    # as Bridge's MixtralModelProvider sets them (its MixtralBridge takes moe_aux_loss_coeff from
    # the HF router_aux_loss_coef, as we do; its load balancing is off)
    megatron_moe_training = dict(moe_router_load_balancing_type="none", moe_grouped_gemm=True,
                                 moe_permute_fusion=True)
    megatron_priority = 10
    tiny = dict(vocab_size=257, intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                num_experts_per_tok=2, tie_word_embeddings=False, rope_theta=1000000.0)
    tiny_note = "4 experts top-2 on every layer"

    def moe_fields(self, hf_config) -> dict:
        get = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
        jitter = get("router_jitter_noise", 0.0) or 0.0
        if jitter:
            raise ConfigError(f"mixtral: router_jitter_noise={jitter} is not supported (set it to "
                              "0.0; the router here is deterministic)")
        experts = get("num_local_experts")
        return dict(num_experts=experts, moe_top_k=get("num_experts_per_tok"),
                    moe_intermediate_size=get("intermediate_size"), norm_topk_prob=True,
                    moe_layer_ids=tuple(range(get("num_hidden_layers"))) if experts else (),
                    router_aux_loss_coef=float(get("router_aux_loss_coef", 0.0)))

    def matches_megatron(self, fields: dict) -> bool:
        return bool(fields["num_moe_experts"])

    def hf_kwargs_from_megatron(self, fields: dict) -> dict:
        flags = moe_layer_flags(fields)
        if not all(flags):
            raise ConfigError(f"moe_layer_freq={fields['moe_layer_freq']!r} makes layers "
                              f"{[i for i, m in enumerate(flags) if not m]} dense: Mixtral has "
                              "experts on every layer (no HF family here matches these settings)")
        return dict(common_moe_hf_kwargs(fields), num_local_experts=fields["num_moe_experts"],
                    intermediate_size=fields["moe_ffn_hidden_size"])
