"""The declarative weight map of the Llama family: HF tensor(s) <-> our parameter <-> megatron-core
key, and the rule that fuses / splits / shards it. The loader, the saver, ``hf2mcore``,
``mcore2hf`` and ``save_mcore`` all read this one table.

Rules (what a TP rank holds of the HF tensor(s)):
- ``qkv``        q, k, v fused: this rank's q heads, then its KV heads' k, then v (KV heads
                 replicated when there are fewer than TP ranks)
- ``gate_up``    gate and up fused: this rank's gate rows, then its up rows
- ``column``     rows split evenly (dim 0)
- ``row``        columns split evenly (dim 1)
- ``vocab``      rows split over the vocab padded to a multiple of TP (padding rows are zero)
- ``replicated`` the whole tensor on every rank

megatron-core side (``WeightRule.mcore``): the key of megatron-core 0.16's
``GPTModel.sharded_state_dict()``. Per-layer keys are stacked: one tensor with a leading layer axis
(``decoder.layers.self_attention.linear_qkv.weight`` is ``[num_layers, rows, hidden]``). The fused
QKV is grouped per KV head, ``[q heads of group g; k_g; v_g]`` for each group g; ``linear_fc1`` is
``[gate; up]``; every other tensor has the HF layout. Norm names are the transformer-engine ones,
which megatron-core's local spec also saves under (its ``sharded_state_dict_keys_map``);
``LOCAL_SPEC_NAMES`` gives the raw module names of a local spec without that map.
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
    mcore: str                # megatron-core dist-checkpoint key (per-layer keys: stacked)
    per_layer: bool = False


MCORE_LAYER_PREFIX = "decoder.layers."
# megatron-core's local spec maps its norms to the transformer-engine names when it saves
# (``sharded_state_dict_keys_map``); these are the module names a local spec without that map uses.
LOCAL_SPEC_NAMES = {
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": "decoder.layers.input_layernorm.weight",
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": "decoder.layers.pre_mlp_layernorm.weight",
}
# the linears of a layer: megatron-core saves an ``_extra_state`` object for each, and its default
# (strict) load asks for them
MCORE_EXTRA_STATE_KEYS = tuple(
    f"decoder.layers.{m}._extra_state" for m in
    ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"))


def mcore_key(rule: WeightRule, layer_spec: str = "te") -> str:
    """The megatron-core key of ``rule`` under the ``te`` (default) or ``local`` naming."""
    if layer_spec not in ("te", "local"):
        raise ValueError(f"layer_spec must be 'te' or 'local', got {layer_spec!r}")
    return LOCAL_SPEC_NAMES.get(rule.mcore, rule.mcore) if layer_spec == "local" else rule.mcore


def weight_rules(config: ModelConfig, head_kind: str, *, pre_process: bool = True,
                 post_process: bool = True) -> list[WeightRule]:
    """The rules for one (pipeline stage of a) model: CausalLM or Value head."""
    L = "model.layers.{i}."
    M = MCORE_LAYER_PREFIX
    rules: list[WeightRule] = []
    if pre_process:
        rules.append(WeightRule("model.embed_tokens.weight", ("model.embed_tokens.weight",), "vocab",
                                "embedding.word_embeddings.weight"))
    layer = [
        WeightRule(L + "input_layernorm.weight", (L + "input_layernorm.weight",), "replicated",
                   M + "self_attention.linear_qkv.layer_norm_weight"),
        WeightRule(L + "self_attn.qkv_proj.weight",
                   tuple(L + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv",
                   M + "self_attention.linear_qkv.weight"),
        WeightRule(L + "self_attn.o_proj.weight", (L + "self_attn.o_proj.weight",), "row",
                   M + "self_attention.linear_proj.weight"),
        WeightRule(L + "post_attention_layernorm.weight",
                   (L + "post_attention_layernorm.weight",), "replicated",
                   M + "mlp.linear_fc1.layer_norm_weight"),
        WeightRule(L + "mlp.gate_up_proj.weight",
                   (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), "gate_up",
                   M + "mlp.linear_fc1.weight"),
        WeightRule(L + "mlp.down_proj.weight", (L + "mlp.down_proj.weight",), "row",
                   M + "mlp.linear_fc2.weight"),
    ]
    if config.qkv_bias:
        layer.append(WeightRule(L + "self_attn.qkv_proj.bias",
                                tuple(L + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv",
                                M + "self_attention.linear_qkv.bias"))
    if config.o_bias:
        layer.append(WeightRule(L + "self_attn.o_proj.bias", (L + "self_attn.o_proj.bias",),
                                "replicated", M + "self_attention.linear_proj.bias"))
    if config.mlp_bias:
        layer += [WeightRule(L + "mlp.gate_up_proj.bias",
                             (L + "mlp.gate_proj.bias", L + "mlp.up_proj.bias"), "gate_up",
                             M + "mlp.linear_fc1.bias"),
                  WeightRule(L + "mlp.down_proj.bias", (L + "mlp.down_proj.bias",), "replicated",
                             M + "mlp.linear_fc2.bias")]
    rules += [dataclasses.replace(r, per_layer=True) for r in layer]
    if post_process:
        rules.append(WeightRule("model.norm.weight", ("model.norm.weight",), "replicated",
                                "decoder.final_layernorm.weight"))
        if head_kind == "value":
            # a value head is megatron's output layer with one row (verl's critic layout)
            rules.append(WeightRule("value_head.weight", ("score.weight",), "replicated",
                                    "output_layer.weight"))
        elif not config.tie_word_embeddings:
            rules.append(WeightRule("lm_head.proj.weight", ("lm_head.weight",), "vocab",
                                    "output_layer.weight"))
        elif not pre_process:
            # a last pipeline stage with tied embeddings keeps its own copy of the embedding
            # (megatron-core saves it as a non-main replica of the embedding)
            rules.append(WeightRule("lm_head.proj.weight", ("model.embed_tokens.weight",), "vocab",
                                    "embedding.word_embeddings.weight"))
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


# ---- the inverse: TP shards -> HF tensors ------------------------------------------------------------
def hf_shapes(rule: WeightRule, config: ModelConfig) -> list[tuple[int, ...]]:
    """Shapes of the HF tensors of ``rule`` (in the order of ``rule.hf``), from the config alone."""
    h, d, ffn = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    name = rule.ours.rsplit(".", 1)
    bias = name[-1] == "bias"
    kind = rule.rule
    if kind == "qkv":
        return [(q,), (kv,), (kv,)] if bias else [(q, h), (kv, h), (kv, h)]
    if kind == "gate_up":
        return [(ffn,), (ffn,)] if bias else [(ffn, h), (ffn, h)]
    if kind == "vocab":
        return [(config.vocab_size, h)]
    if rule.ours.endswith("self_attn.o_proj.weight"):
        return [(h, q)]
    if rule.ours.endswith("mlp.down_proj.weight"):
        return [(h, ffn)]
    if rule.ours == "value_head.weight":
        return [(1, h)]
    if kind == "replicated":  # norms and the biases of row-parallel linears
        return [(h,)]
    raise ValueError(f"no HF shape known for {rule.ours} ({kind})")


def merge_to_hf(rule: WeightRule, shards: list[torch.Tensor], config: ModelConfig
                ) -> list[torch.Tensor]:
    """The inverse of :func:`shard_from_hf`: the shards of every TP rank (by rank) -> the HF
    tensors of ``rule`` (in the order of ``rule.hf``). q/k/v and gate/up are split back, KV heads
    replicated over TP ranks are taken once, vocab padding rows are dropped."""
    tp = len(shards)
    kind = rule.rule
    if kind == "replicated":
        return [shards[0]]
    if kind == "column":
        return [torch.cat(shards, dim=0)]
    if kind == "row":
        return [torch.cat(shards, dim=1)]
    if kind == "vocab":
        return [torch.cat(shards, dim=0)[: config.vocab_size]]
    if kind == "gate_up":
        per = config.intermediate_size // tp
        gates, ups = zip(*(s.split([per, per], dim=0) for s in shards))
        return [torch.cat(gates, dim=0), torch.cat(ups, dim=0)]
    if kind == "qkv":
        d = config.head_dim
        q_size = config.num_attention_heads // tp * d
        kv_size = config.kv_heads_per_rank(tp) * d
        qs, ks, vs, seen = [], [], [], set()
        for rank, shard in enumerate(shards):
            q, k, v = shard.split([q_size, kv_size, kv_size], dim=0)
            qs.append(q)
            kv0 = config.kv_head_index(tp, rank)
            if kv0 not in seen:  # replicated KV heads: the first rank of each group
                seen.add(kv0)
                ks.append(k)
                vs.append(v)
        return [torch.cat(qs, dim=0), torch.cat(ks, dim=0), torch.cat(vs, dim=0)]
    raise ValueError(f"unknown weight rule {kind!r} for {rule.ours}")


# ---- megatron-core layout ------------------------------------------------------------------------------
def _qkv_groups(config: ModelConfig) -> tuple[int, int, int]:
    """(KV groups, q heads per group, head_dim)."""
    g = config.num_key_value_heads
    return g, config.num_attention_heads // g, config.head_dim


def hf_to_mcore(rule: WeightRule, tensors: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """HF tensors of ``rule`` -> the whole (one layer of the) megatron-core tensor."""
    if rule.rule == "qkv":
        g, qpg, d = _qkv_groups(config)
        q, k, v = tensors
        rest = q.shape[1:]
        fused = torch.cat([q.reshape(g, qpg * d, *rest), k.reshape(g, d, *rest),
                           v.reshape(g, d, *rest)], dim=1)
        return fused.reshape(g * (qpg + 2) * d, *rest)
    if rule.rule == "gate_up":
        return torch.cat(tensors, dim=0)
    return tensors[0]


def mcore_to_hf(rule: WeightRule, tensor: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
    """The inverse of :func:`hf_to_mcore` (vocab rows beyond ``vocab_size`` dropped)."""
    if rule.rule == "qkv":
        g, qpg, d = _qkv_groups(config)
        rest = tensor.shape[1:]
        q, k, v = tensor.reshape(g, (qpg + 2) * d, *rest).split([qpg * d, d, d], dim=1)
        return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]
    if rule.rule == "gate_up":
        return list(tensor.split(config.intermediate_size, dim=0))
    if rule.rule == "vocab":
        return [tensor[: config.vocab_size]]
    return [tensor]


def mcore_rows(rule: WeightRule, component: int, start: int, end: int, config: ModelConfig
               ) -> list[tuple[int, int]]:
    """Rows ``[start, end)`` of HF tensor ``rule.hf[component]`` as row ranges of the megatron-core
    tensor (contiguous runs merged), in order."""
    if rule.rule == "gate_up":
        off = component * config.intermediate_size
        return [(start + off, end + off)]
    if rule.rule != "qkv":
        return [(start, end)]
    g, qpg, d = _qkv_groups(config)
    stride = (qpg + 2) * d
    if component == 0:
        per, base = qpg * d, 0
    else:
        per, base = d, qpg * d + (component - 1) * d
    out: list[tuple[int, int]] = []
    row = start
    while row < end:
        grp, within = divmod(row, per)
        n = min(per - within, end - row)
        a = grp * stride + base + within
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], a + n)
        else:
            out.append((a, a + n))
        row += n
    return out


@dataclasses.dataclass(frozen=True)
class McorePiece:
    """One chunk of a megatron-core tensor held by a TP rank: ``tensor`` is block ``index`` of
    ``count`` equal blocks along ``axis`` (None: the whole tensor); ``replica`` 0 = the copy saved."""

    tensor: torch.Tensor
    axis: int | None
    index: int
    count: int
    replica: int


def mcore_pieces(rule: WeightRule, shard: torch.Tensor, config: ModelConfig, tp: int, rank: int
                 ) -> list[McorePiece]:
    """This TP rank's shard of our parameter -> its chunks of the megatron-core tensor (the layer
    axis not included). Mirrors what megatron-core's own ``sharded_state_dict()`` declares: the
    row/column split of each linear, gate and up as blocks ``rank`` and ``tp + rank`` of ``2 tp``,
    QKV as this rank's KV groups. With fewer KV heads than TP ranks (which megatron-core itself
    cannot run) the QKV goes per head: each q head is one block, k and v of the shared group are
    replicas of the group's first rank."""
    kind = rule.rule
    if kind == "replicated":
        return [McorePiece(shard, None, 0, 1, rank)]
    if kind in ("column", "vocab"):
        return [McorePiece(shard, 0, rank, tp, 0)]
    if kind == "row":
        return [McorePiece(shard, 1, rank, tp, 0)]
    if kind == "gate_up":
        gate, up = shard.chunk(2, dim=0)
        return [McorePiece(gate, 0, rank, 2 * tp, 0), McorePiece(up, 0, tp + rank, 2 * tp, 0)]
    if kind == "qkv":
        g, qpg, d = _qkv_groups(config)
        hq = config.num_attention_heads // tp
        kv_local = config.kv_heads_per_rank(tp)
        q, k, v = shard.split([hq * d, kv_local * d, kv_local * d], dim=0)
        rest = shard.shape[1:]
        if g >= tp:  # whole groups on this rank: reorder to [q_g; k_g; v_g] per group
            local = torch.cat([q.reshape(kv_local, qpg * d, *rest), k.reshape(kv_local, d, *rest),
                               v.reshape(kv_local, d, *rest)], dim=1)
            return [McorePiece(local.reshape(-1, *rest), 0, rank, tp, 0)]
        blocks = g * (qpg + 2)
        grp = config.kv_head_index(tp, rank)
        first_head = rank * hq
        pieces = [McorePiece(q[j * d:(j + 1) * d], 0, grp * (qpg + 2) + (first_head + j - grp * qpg),
                             blocks, 0) for j in range(hq)]
        replica = rank % (tp // g)
        pieces += [McorePiece(k, 0, grp * (qpg + 2) + qpg, blocks, replica),
                   McorePiece(v, 0, grp * (qpg + 2) + qpg + 1, blocks, replica)]
        return pieces
    raise ValueError(f"unknown weight rule {kind!r} for {rule.ours}")
