"""The MoE settings the MoE families share: reading ``decoder_sparse_step`` / ``mlp_only_layers``
as transformers does (Qwen2-MoE, Qwen3-MoE) and the HF arguments of those families from
Megatron settings (``moe_layer_freq``)."""

from __future__ import annotations

from parallel_models.errors import ConfigError

QWEN_MOE_HF_NAMES = ("mlp", ("gate_proj", "up_proj", "down_proj"))


def qwen_moe_fields(hf_config, model_type: str, *, shared_expert: bool) -> dict:
    """ModelConfig's MoE fields from a Qwen2-MoE / Qwen3-MoE config, with the MoE layers chosen
    exactly as transformers does; ``shared_expert``: read the gated shared expert (Qwen2-MoE)."""
    get = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
    layers = get("num_hidden_layers")
    experts = get("num_experts") or 0
    step = get("decoder_sparse_step", 1)
    if experts and (not isinstance(step, int) or step < 1):
        raise ConfigError(f"{model_type}: decoder_sparse_step must be a positive integer, got "
                          f"{step!r}")
    mlp_only = set(get("mlp_only_layers") or ())
    moe_layers = tuple(i for i in range(layers)
                       if i not in mlp_only and experts > 0 and (i + 1) % step == 0)
    shared = (get("shared_expert_intermediate_size") or 0) if shared_expert else 0
    return dict(num_experts=experts, moe_top_k=get("num_experts_per_tok") or 0,
                moe_intermediate_size=get("moe_intermediate_size") or 0,
                norm_topk_prob=bool(get("norm_topk_prob", False)),
                shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0,
                moe_layer_ids=moe_layers,
                router_aux_loss_coef=float(get("router_aux_loss_coef", 0.0)))


def moe_layer_flags(fields: dict) -> list[int]:
    """Megatron's ``moe_layer_freq`` (an int or a per-layer list) as a per-layer 0/1 list."""
    freq = fields["moe_layer_freq"]
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(fields["num_layers"])]
    return list(freq or [1] * fields["num_layers"])


def common_moe_hf_kwargs(fields: dict) -> dict:
    return dict(num_experts_per_tok=fields["moe_router_topk"],
                norm_topk_prob=not fields["moe_router_pre_softmax"])


def qwen_moe_hf_kwargs(fields: dict) -> dict:
    """Qwen2-MoE / Qwen3-MoE HF arguments from megatron MoE settings."""
    return dict(common_moe_hf_kwargs(fields), num_experts=fields["num_moe_experts"],
                moe_intermediate_size=fields["moe_ffn_hidden_size"], decoder_sparse_step=1,
                mlp_only_layers=[i for i, m in enumerate(moe_layer_flags(fields)) if not m])
