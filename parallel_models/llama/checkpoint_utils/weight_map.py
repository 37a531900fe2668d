"""The declarative weight map of the Llama family: HF tensor(s) <-> our parameter, and the rule
that fuses / splits / shards it. The loader, the saver and the converters all read this table.

Rules (what a TP rank holds of the HF tensor(s)):
- ``qkv``        q, k, v fused: this rank's q heads, then its KV heads' k, then v (KV heads
                 replicated when there are fewer than TP ranks)
- ``gate_up``    gate and up fused: this rank's gate rows, then its up rows
- ``column``     rows split evenly (dim 0)
- ``row``        columns split evenly (dim 1)
- ``vocab``      rows split over the vocab padded to a multiple of TP (padding rows are zero)
- ``replicated`` the whole tensor on every rank
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from parallel_models.config import ModelConfig

# read(name, dim, start, end) -> the slice [start:end) of HF tensor `name` along `dim`
# (dim None: the whole tensor)
SliceReader = Callable[[str, "int | None", "int | None", "int | None"], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class WeightRule:
    ours: str                 # parameter name in our model; "{i}" = local layer index
    hf: tuple[str, ...]       # HF tensor names; "{i}" = global layer index
    rule: str
    per_layer: bool = False


def weight_rules(config: ModelConfig, head_kind: str, *, pre_process: bool = True,
                 post_process: bool = True) -> list[WeightRule]:
    """The rules for one (pipeline stage of a) model: CausalLM or Value head."""
    L = "model.layers.{i}."
    rules: list[WeightRule] = []
    if pre_process:
        rules.append(WeightRule("model.embed_tokens.weight", ("model.embed_tokens.weight",), "vocab"))
    layer = [
        WeightRule(L + "input_layernorm.weight", (L + "input_layernorm.weight",), "replicated"),
        WeightRule(L + "self_attn.qkv_proj.weight",
                   tuple(L + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
        WeightRule(L + "self_attn.o_proj.weight", (L + "self_attn.o_proj.weight",), "row"),
        WeightRule(L + "post_attention_layernorm.weight",
                   (L + "post_attention_layernorm.weight",), "replicated"),
        WeightRule(L + "mlp.gate_up_proj.weight",
                   (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), "gate_up"),
        WeightRule(L + "mlp.down_proj.weight", (L + "mlp.down_proj.weight",), "row"),
    ]
    if config.qkv_bias:
        layer.append(WeightRule(L + "self_attn.qkv_proj.bias",
                                tuple(L + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"))
    if config.o_bias:
        layer.append(WeightRule(L + "self_attn.o_proj.bias", (L + "self_attn.o_proj.bias",),
                                "replicated"))
    if config.mlp_bias:
        layer += [WeightRule(L + "mlp.gate_up_proj.bias",
                             (L + "mlp.gate_proj.bias", L + "mlp.up_proj.bias"), "gate_up"),
                  WeightRule(L + "mlp.down_proj.bias", (L + "mlp.down_proj.bias",), "replicated")]
    rules += [dataclasses.replace(r, per_layer=True) for r in layer]
    if post_process:
        rules.append(WeightRule("model.norm.weight", ("model.norm.weight",), "replicated"))
        if head_kind == "value":
            rules.append(WeightRule("value_head.weight", ("score.weight",), "replicated"))
        elif not config.tie_word_embeddings:
            rules.append(WeightRule("lm_head.proj.weight", ("lm_head.weight",), "vocab"))
        elif not pre_process:
            # a last pipeline stage with tied embeddings keeps its own copy of the embedding
            rules.append(WeightRule("lm_head.proj.weight", ("model.embed_tokens.weight",), "vocab"))
    return rules


def _even(total: int, tp: int, rank: int) -> tuple[int, int]:
    per = total // tp
    return rank * per, (rank + 1) * per


def shard_from_hf(rule: WeightRule, names: tuple[str, ...], read: SliceReader,
                  config: ModelConfig, tp: int, rank: int) -> torch.Tensor:
    """This rank's shard of one of our parameters, read slice by slice from HF tensors."""
    d = config.head_dim
    kind = rule.rule
    if kind == "replicated":
        return read(names[0], None, None, None)
    if kind == "column":
        total = read.shape(names[0])[0]
        return read(names[0], 0, *_even(total, tp, rank))
    if kind == "row":
        total = read.shape(names[0])[1]
        return read(names[0], 1, *_even(total, tp, rank))
    if kind == "vocab":
        padded = config.padded_vocab_size(tp)
        start, end = _even(padded, tp, rank)
        real_end = min(end, config.vocab_size)
        part = read(names[0], 0, start, real_end) if real_end > start else None
        if real_end == end:
            return part
        shape = (end - start, *read.shape(names[0])[1:])
        out = torch.zeros(shape, dtype=read.dtype(names[0]))
        if part is not None:
            out[: real_end - start] = part
        return out
    if kind == "qkv":
        hq = config.num_attention_heads // tp
        kv_local = config.kv_heads_per_rank(tp)
        kv0 = config.kv_head_index(tp, rank)
        q = read(names[0], 0, rank * hq * d, (rank + 1) * hq * d)
        k = read(names[1], 0, kv0 * d, (kv0 + kv_local) * d)
        v = read(names[2], 0, kv0 * d, (kv0 + kv_local) * d)
        return torch.cat([q, k, v], dim=0)
    if kind == "gate_up":
        start, end = _even(config.intermediate_size, tp, rank)
        return torch.cat([read(names[0], 0, start, end), read(names[1], 0, start, end)], dim=0)
    raise ValueError(f"unknown weight rule {kind!r} for {rule.ours}")
