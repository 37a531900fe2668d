"""The MoE settings the MoE families share: reading ``decoder_sparse_step`` / ``mlp_only_layers``
as transformers does (Qwen2-MoE, Qwen3-MoE) and the HF arguments of those families from
Megatron settings (``moe_layer_freq``)."""

from __future__ import annotations

import ast

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


def _pattern_value(node):
    """The value of a Megatron-LM ``--moe-layer-freq`` pattern expression (lists of integers,
    ``+`` and ``*``: "([1]*3+[0])*2"), evaluated without ``eval``."""
    if isinstance(node, ast.Expression):
        return _pattern_value(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_pattern_value(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern_value(node.left), _pattern_value(node.right)
        if isinstance(node.op, ast.Mult) and len(left if isinstance(left, list) else right
                                                 if isinstance(right, list) else []) * (
                right if isinstance(left, list) else left if isinstance(right, list) else 1
        ) > 1 << 20:
            raise ValueError("the pattern is far longer than any model's layer count")
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"unsupported element {type(node).__name__}")


def moe_layer_flags(fields: dict) -> list[int]:
    """Megatron's ``moe_layer_freq`` as a per-layer 0/1 list, in every form megatron-core and
    Megatron-LM accept: an integer N (every N-th layer from layer 0 is MoE, as
    ``get_gpt_decoder_block_spec`` reads it), a list of 0/1 per layer, or Megatron-LM's string
    (an integer, or a pattern such as "([1]*3+[0]*1)*2"); absent: every layer. Anything else is
    a ConfigError naming the setting."""
    freq = fields.get("moe_layer_freq")
    layers = fields["num_layers"]
    if freq is None:
        return [1] * layers
    given = freq
    if isinstance(freq, str):
        try:
            freq = _pattern_value(ast.parse(freq.strip(), mode="eval"))
        except (SyntaxError, ValueError, TypeError, MemoryError) as err:
            raise ConfigError(f"moe_layer_freq={given!r}: not an integer, a list of 0/1 or a "
                              f"pattern such as '([1]*3+[0]*1)*2' ({err})") from None
    if isinstance(freq, tuple):
        freq = list(freq)
    if type(freq) is int:
        if freq < 1:
            raise ConfigError(f"moe_layer_freq={given!r}: an integer must be >= 1")
        return [1 if i % freq == 0 else 0 for i in range(layers)]
    if isinstance(freq, list):
        if len(freq) != layers or any(type(v) is not int or v not in (0, 1) for v in freq):
            raise ConfigError(f"moe_layer_freq={given!r}: a list must hold one 0 or 1 per "
                              f"layer (num_layers={layers})")
        return list(freq)
    raise ConfigError(f"moe_layer_freq={given!r} ({type(given).__name__}): expected an integer, "
                      "a list of 0/1 per layer or a pattern string")


def common_moe_hf_kwargs(fields: dict) -> dict:
    return dict(num_experts_per_tok=fields["moe_router_topk"],
                norm_topk_prob=not fields["moe_router_pre_softmax"])


def qwen_moe_hf_kwargs(fields: dict) -> dict:
    """Qwen2-MoE / Qwen3-MoE HF arguments from megatron MoE settings."""
    return dict(common_moe_hf_kwargs(fields), num_experts=fields["num_moe_experts"],
                moe_intermediate_size=fields["moe_ffn_hidden_size"], decoder_sparse_step=1,
                mlp_only_layers=[i for i, m in enumerate(moe_layer_flags(fields)) if not m])
