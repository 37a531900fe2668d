"""Weight rules: how one of our (tensor-parallel) parameters relates to its HF tensor(s) and to its
megatron-core tensor, one class per rule.

Every rule implements the same pure transforms (no communication, no I/O but the slice reader it
is handed), so the loader, the savers and both converters use one implementation each and the
rules can be tested on one CPU:

- ``hf_shapes(config)``                 shapes of the HF tensors (in the mapping's order)
- ``shard(read, names, config, tp, rank)`` this TP rank's piece, read slice by slice
- ``merge(shards, config)``             the pieces of every TP rank -> the HF tensors
- ``to_mcore(tensors, config)`` / ``from_mcore(tensor, config)``  HF <-> megatron-core layout
- ``mcore_rows(component, start, end, config)``  HF rows as row ranges of the megatron tensor
- ``mcore_pieces(shard, config, tp, rank)``  a TP shard as the chunks megatron-core declares
- ``mcore_blocks(config)``              the chunks a one-process save writes (gate-up: two)

Shapes are written as dim names resolved against the config: ``hidden``, ``q`` (all query
heads x head_dim), ``kv`` (all KV heads x head_dim), ``ffn``, ``vocab`` and ``one``.
The megatron-core layout is the one of ``GPTModel.sharded_state_dict()``: fused QKV grouped per
KV head (``[q heads of group g; k_g; v_g]`` for each g), ``linear_fc1`` = ``[gate; up]``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from parallel_models.config import ModelConfig

# read(name, dim, start, end) -> the slice [start:end) of HF tensor `name` along `dim` (dim None:
# the whole tensor); the reader also has .shape(name) and .dtype(name)
SliceReader = Callable[[str, "int | None", "int | None", "int | None"], torch.Tensor]


def dim_size(config: ModelConfig, name: str) -> int:
    sizes = {"hidden": config.hidden_size, "ffn": config.intermediate_size,
             "q": config.num_attention_heads * config.head_dim,
             "kv": config.num_key_value_heads * config.head_dim,
             "vocab": config.vocab_size, "one": 1, "head_dim": config.head_dim,
             # MoE: the router's rows, a routed expert's and the shared expert's SwiGLU width
             "experts": config.num_experts, "moe_ffn": config.moe_intermediate_size,
             "shared_ffn": config.shared_expert_intermediate_size}
    if name not in sizes:
        raise ValueError(f"unknown dim name {name!r}; known: {', '.join(sizes)}")
    return sizes[name]


def _even(total: int, tp: int, rank: int) -> tuple[int, int]:
    per = total // tp
    return rank * per, (rank + 1) * per


@dataclasses.dataclass(frozen=True)
class McorePiece:
    """One chunk of a megatron-core tensor held by a TP rank: ``tensor`` is block ``index`` of
    ``count`` equal blocks along ``axis`` (None: the whole tensor); ``replica`` 0 = the copy saved."""

    tensor: torch.Tensor
    axis: int | None
    index: int
    count: int
    replica: int


class WeightRule:
    """Base: one HF tensor, the same layout in megatron-core. Subclasses say how TP splits it."""

    split_over_tp = True  # False: every TP rank holds the whole tensor

    def __init__(self, *shape: str):
        self.shape = shape

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self.shape))})"

    def hf_shapes(self, config: ModelConfig) -> list[tuple[int, ...]]:
        return [tuple(dim_size(config, d) for d in self.shape)]

    def shard(self, read: SliceReader, names, config: ModelConfig, tp: int, rank: int
              ) -> torch.Tensor:
        raise NotImplementedError

    def merge(self, shards: list[torch.Tensor], config: ModelConfig) -> list[torch.Tensor]:
        raise NotImplementedError

    def mcore_pieces(self, shard: torch.Tensor, config: ModelConfig, tp: int, rank: int
                     ) -> list[McorePiece]:
        raise NotImplementedError

    # -- megatron-core layout: the HF layout unless a subclass fuses --
    def mcore_shape(self, config: ModelConfig) -> tuple[int, ...]:
        shapes = self.hf_shapes(config)
        return (sum(s[0] for s in shapes), *shapes[0][1:])

    def mcore_shape_ok(self, got: tuple[int, ...], want: tuple[int, ...]) -> bool:
        """Whether a stored megatron tensor of shape ``got`` serves the expected ``want``."""
        return tuple(got) == tuple(want)

    def to_mcore(self, tensors: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
        return tensors[0]

    def from_mcore(self, tensor: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
        return [tensor]

    def mcore_rows(self, component: int, start: int, end: int, config: ModelConfig
                   ) -> list[tuple[int, int]]:
        """Rows ``[start, end)`` of HF tensor ``component`` as row ranges of the megatron-core
        tensor (contiguous runs merged), in order."""
        return [(start, end)]

    def mcore_blocks(self, config: ModelConfig) -> list[tuple[int, ...]]:
        """The chunks a one-process megatron-core save writes, as the HF components of each."""
        return [tuple(range(len(self.hf_shapes(config))))]


class Replicated(WeightRule):
    """The whole tensor on every TP rank (norms, biases of row-parallel linears, the value head)."""

    split_over_tp = False

    def shard(self, read, names, config, tp, rank):
        return read(names[0], None, None, None)

    def merge(self, shards, config):
        return [shards[0]]

    def mcore_pieces(self, shard, config, tp, rank):
        return [McorePiece(shard, None, 0, 1, rank)]


class ColumnSplit(WeightRule):
    """Rows split evenly over TP ranks (a column-parallel linear's weight)."""

    axis = 0

    def shard(self, read, names, config, tp, rank):
        total = read.shape(names[0])[self.axis]
        return read(names[0], self.axis, *_even(total, tp, rank))

    def merge(self, shards, config):
        return [torch.cat(shards, dim=self.axis)]

    def mcore_pieces(self, shard, config, tp, rank):
        return [McorePiece(shard, self.axis, rank, tp, 0)]


class RowSplit(ColumnSplit):
    """Columns split evenly over TP ranks (a row-parallel linear's weight)."""

    axis = 1


class VocabSplit(WeightRule):
    """Rows split over the vocab padded to a multiple of TP; padding rows are zero here and
    dropped on the way back. Stored tensors hold the true vocab; megatron may store more rows."""

    def __init__(self):
        super().__init__("vocab", "hidden")

    def shard(self, read, names, config, tp, rank):
        start, end = _even(config.padded_vocab_size(tp), tp, rank)
        real_end = min(end, config.vocab_size)
        part = read(names[0], 0, start, real_end) if real_end > start else None
        if real_end == end:
            return part
        out = torch.zeros((end - start, *read.shape(names[0])[1:]), dtype=read.dtype(names[0]))
        if part is not None:
            out[: real_end - start] = part
        return out

    def merge(self, shards, config):
        return [torch.cat(shards, dim=0)[: config.vocab_size]]

    def mcore_pieces(self, shard, config, tp, rank):
        return [McorePiece(shard, 0, rank, tp, 0)]

    def mcore_shape_ok(self, got, want):
        return len(got) == 2 and got[0] >= want[0] and got[1] == want[1]

    def from_mcore(self, tensor, config):
        return [tensor[: config.vocab_size]]


class FusedGateUp(WeightRule):
    """gate and up fused: each rank holds its gate rows then its up rows; megatron-core's
    ``linear_fc1`` is ``[gate; up]``, declared as blocks ``rank`` and ``tp + rank`` of ``2 tp``.
    ``ffn``: the dim name of the width (``ffn``; ``moe_ffn`` / ``shared_ffn`` for MoE experts)."""

    def __init__(self, bias: bool = False, ffn: str = "ffn"):
        super().__init__(*((ffn,) if bias else (ffn, "hidden")))
        self.ffn = ffn

    def hf_shapes(self, config):
        return super().hf_shapes(config) * 2

    def shard(self, read, names, config, tp, rank):
        start, end = _even(dim_size(config, self.ffn), tp, rank)
        return torch.cat([read(names[0], 0, start, end), read(names[1], 0, start, end)], dim=0)

    def merge(self, shards, config):
        per = dim_size(config, self.ffn) // len(shards)
        gates, ups = zip(*(s.split([per, per], dim=0) for s in shards))
        return [torch.cat(gates, dim=0), torch.cat(ups, dim=0)]

    def to_mcore(self, tensors, config):
        return torch.cat(tensors, dim=0)

    def from_mcore(self, tensor, config):
        return list(tensor.split(dim_size(config, self.ffn), dim=0))

    def mcore_rows(self, component, start, end, config):
        off = component * dim_size(config, self.ffn)
        return [(start + off, end + off)]

    def mcore_pieces(self, shard, config, tp, rank):
        gate, up = shard.chunk(2, dim=0)
        return [McorePiece(gate, 0, rank, 2 * tp, 0), McorePiece(up, 0, tp + rank, 2 * tp, 0)]

    def mcore_blocks(self, config):
        return [(0,), (1,)]  # megatron-core saves its SwiGLU fc1 as two chunks


class FusedQKV(WeightRule):
    """q, k, v fused: each rank holds its q heads, then its KV heads' k, then v (KV heads
    replicated when there are fewer than TP ranks). megatron-core groups per KV head."""

    def __init__(self, bias: bool = False):
        super().__init__(*(() if bias else ("hidden",)))
        self.bias = bias

    def __repr__(self) -> str:
        return f"FusedQKV(bias={self.bias})"

    def hf_shapes(self, config):
        rest = tuple(dim_size(config, d) for d in self.shape)
        return [(dim_size(config, "q"), *rest), (dim_size(config, "kv"), *rest),
                (dim_size(config, "kv"), *rest)]

    @staticmethod
    def _groups(config) -> tuple[int, int, int]:
        """(KV groups, q heads per group, head_dim)."""
        g = config.num_key_value_heads
        return g, config.num_attention_heads // g, config.head_dim

    def shard(self, read, names, config, tp, rank):
        d = config.head_dim
        hq = config.num_attention_heads // tp
        kv_local = config.kv_heads_per_rank(tp)
        kv0 = config.kv_head_index(tp, rank)
        q = read(names[0], 0, rank * hq * d, (rank + 1) * hq * d)
        k = read(names[1], 0, kv0 * d, (kv0 + kv_local) * d)
        v = read(names[2], 0, kv0 * d, (kv0 + kv_local) * d)
        return torch.cat([q, k, v], dim=0)

    def merge(self, shards, config):
        tp = len(shards)
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

    def to_mcore(self, tensors, config):
        g, qpg, d = self._groups(config)
        q, k, v = tensors
        rest = q.shape[1:]
        fused = torch.cat([q.reshape(g, qpg * d, *rest), k.reshape(g, d, *rest),
                           v.reshape(g, d, *rest)], dim=1)
        return fused.reshape(g * (qpg + 2) * d, *rest)

    def from_mcore(self, tensor, config):
        g, qpg, d = self._groups(config)
        rest = tensor.shape[1:]
        q, k, v = tensor.reshape(g, (qpg + 2) * d, *rest).split([qpg * d, d, d], dim=1)
        return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]

    def mcore_rows(self, component, start, end, config):
        g, qpg, d = self._groups(config)
        stride = (qpg + 2) * d
        per, base = (qpg * d, 0) if component == 0 else (d, qpg * d + (component - 1) * d)
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

    def mcore_pieces(self, shard, config, tp, rank):
        """Whole KV groups on this rank: one block reordered to ``[q_g; k_g; v_g]``. With fewer
        KV heads than TP ranks (which megatron-core itself cannot run) per head: each q head
        is one block, k and v of the shared group are replicas of the group's first rank."""
        g, qpg, d = self._groups(config)
        hq = config.num_attention_heads // tp
        kv_local = config.kv_heads_per_rank(tp)
        q, k, v = shard.split([hq * d, kv_local * d, kv_local * d], dim=0)
        rest = shard.shape[1:]
        if g >= tp:
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
