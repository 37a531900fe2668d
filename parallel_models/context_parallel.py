"""Context parallelism (CP) for packed sequences: load-balanced chunking and the CP collectives.

Each sequence of a packed batch (``cu_seqlens``) is padded at its end to a multiple of ``2 * CP``
tokens and cut into ``2 * CP`` equal chunks; CP rank ``r`` holds chunks ``r`` and
``2 * CP - 1 - r`` (megatron-core's ``get_batch_on_this_cp_rank`` / THD scheme), so every rank has
the same share of the causal attention work. The padding tokens sit after the real ones of their
sequence, so causal attention never lets a real token see them; a last padding-only sequence makes
the local token count divisible by TP under sequence parallel. Positions stay the global positions
of each chunk. :class:`ContextParallelShard` describes one rank's share (its tokens, the order of
the gathered keys for attention) and gathers per-token outputs back to the original token order.

Collectives (all over the CP group):
- :func:`all_gather_kv`: keys/values of all ranks; the backward reduce-scatters dK/dV.
- :meth:`ContextParallelShard.gather_outputs`: per-token outputs (logits, values) of all ranks in
  the original order, on every CP rank. Every CP rank then computes the same loss on them, so the
  backward keeps only this rank's rows, times CP: megatron's DDP sums gradients and its per-token
  loss counts tokens over the data-parallel x CP ranks, which turns that back into the CP = 1
  gradient (the convention of megatron's schedules, which scale the loss by the CP size).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


def _all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate ``x`` of every rank of ``group`` along dim 0 (rank order)."""
    size = dist.get_world_size(group)
    x = x.contiguous()
    if x.is_cuda:
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    blocks = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(blocks, x, group=group)  # gloo has no all_gather_into_tensor
    return torch.cat(blocks, dim=0)


def _reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's block of rows."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    rows = x.shape[0] // size
    if x.is_cuda:
        out = x.new_empty((rows, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x, group=group)
        return out
    dist.all_reduce(x, group=group)  # gloo has no reduce_scatter
    return x[rank * rows:(rank + 1) * rows].clone()


class _AllGatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.group), None


class _GatherOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, x.shape[0]
        return _all_gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        mine = grad[rank * ctx.rows:(rank + 1) * ctx.rows]
        return mine * size, None


def all_gather_kv(x: torch.Tensor, group) -> torch.Tensor:
    """``[local tokens, ...]`` of every CP rank, rank-major; backward: reduce-scatter."""
    return _AllGatherKV.apply(x, group)


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionBlock:
    """One local query chunk: ``length`` queries from local row ``q_start``, attending causally
    (bottom-right aligned) to the first ``k_length`` keys of their sequence, which start at row
    ``k_start`` of the gathered keys in global order."""

    q_start: int
    length: int
    k_start: int
    k_length: int


@dataclasses.dataclass(frozen=True, eq=False)
class ContextParallelShard:
    """One CP rank's share of a packed batch (see the module docstring)."""

    group: object
    size: int
    rank: int
    input_ids: torch.Tensor      # [local] this rank's tokens (padding tokens are 0)
    position_ids: torch.Tensor   # [local] their global positions in their sequences
    cu_seqlens: torch.Tensor     # [n + 1] int32: this rank's rows per sequence (two chunks each)
    max_seqlen: int              # the longest local sequence share
    max_position: int            # 1 + the largest real position of the whole batch (rotary)
    kv_order: torch.Tensor       # [padded total] rank-major gathered row of each global token
    gather_index: torch.Tensor   # [real total] rank-major gathered row of each original token
    blocks: tuple[AttentionBlock, ...]
    next_ids: torch.Tensor       # [local] the next token of each local token (0 where none)
    has_next: torch.Tensor       # [local] bool: the next token is a real one of the same sequence

    def gather_kv(self, x: torch.Tensor) -> torch.Tensor:
        """Local keys or values ``[local, heads, d]`` -> all of them in global padded order."""
        return all_gather_kv(x, self.group).index_select(0, self.kv_order)

    def gather_outputs(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token outputs ``[local, ...]`` -> ``[original tokens, ...]`` in the original order,
        on every CP rank (backward: see the module docstring)."""
        return _GatherOutputs.apply(x.contiguous(), self.group).index_select(0, self.gather_index)

    def next_token_log_probs(self, local_logits: torch.Tensor, with_entropy: bool = False,
                             temperature: float = 1.0, group=None):
        """``log_probs_from_packed_logits`` computed on this rank's vocab-parallel logits
        ``[local, V_local]`` (the labels of the chunks' last tokens come from the next chunk),
        then gathered back: float32 ``[original tokens]`` (and the entropy with
        ``with_entropy``), the same values without gathering the logits. ``group``: the TP
        group (default the training layout's)."""
        from parallel_models.utils.vocab_parallel import (vocab_parallel_log_probs,
                                                          vocab_parallel_log_probs_and_entropy)

        if with_entropy:
            logp, ent = vocab_parallel_log_probs_and_entropy(local_logits, self.next_ids, group,
                                                             temperature=temperature)
        else:
            logp = vocab_parallel_log_probs(local_logits, self.next_ids, group,
                                            temperature=temperature)
            ent = None
        return self.gather_log_probs(logp, ent)

    def gather_log_probs(self, logp: torch.Tensor, entropy: torch.Tensor | None = None):
        """This rank's per-token log-probs of ``next_ids`` (and entropies) -> the original order
        over all ranks, the log-prob 0 where no next token of the same sequence exists."""
        logp = self.gather_outputs(torch.where(self.has_next, logp, torch.zeros_like(logp)))
        return logp if entropy is None else (logp, self.gather_outputs(entropy))


class ShardedCausalLMOutput:
    """A CausalLM output under CP: this rank's final hidden states and the vocab-parallel LM
    head, with its ``shard``. ``local_logits`` (this rank's ``[local, V_local]``) are computed on
    first use, ``logits`` (all tokens in the original order, as without CP) gathered on first
    use; :meth:`next_token_log_probs` needs neither: for more tokens than one chunk of
    ``utils/chunked_logprob.py`` it goes from the hidden states to the log-probs a chunk of
    tokens at a time, so a caller that needs only log-probs and entropy never holds the
    logits."""

    def __init__(self, shard: ContextParallelShard, hidden: torch.Tensor, lm_head,
                 weight: torch.Tensor | None = None, gather_vocab=None):
        self.cp_shard, self.hidden, self.lm_head, self._weight = shard, hidden, lm_head, weight
        self._gather_vocab = gather_vocab
        self._local_logits = self._logits = None

    @property
    def local_logits(self) -> torch.Tensor:
        if self._local_logits is None:
            self._local_logits = self.lm_head(self.hidden, weight=self._weight).squeeze(1)
        return self._local_logits

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            logits = self.cp_shard.gather_outputs(self.local_logits)
            self._logits = logits if self._gather_vocab is None else self._gather_vocab(logits)
        return self._logits

    def next_token_log_probs(self, input_ids=None, cu_seqlens=None, with_entropy: bool = False,
                             temperature: float = 1.0):
        """``ContextParallelShard.next_token_log_probs`` of this output: float32 ``[original
        tokens]`` (and the entropy with ``with_entropy``), gathered over the CP ranks; chunked
        over the tokens (``chunked_head_log_probs``) unless the logits are already there or
        all local tokens fit one chunk. ``input_ids`` / ``cu_seqlens`` (the batch, which the
        shard already holds) are taken for the signature of ``heads/lm_output.py``'s output."""
        from parallel_models.utils.chunked_logprob import chunked_head_log_probs, worth_chunking

        tokens = self.cp_shard.input_ids.shape[0]
        if self._local_logits is not None or not worth_chunking(tokens, self.lm_head.per_rank):
            return self.cp_shard.next_token_log_probs(self.local_logits, with_entropy,
                                                      temperature, self.lm_head.proj.tp_group)
        logp, ent = chunked_head_log_probs(self.hidden, self.lm_head, self.cp_shard.next_ids,
                                           weight=self._weight, with_entropy=with_entropy,
                                           temperature=temperature)
        return self.cp_shard.gather_log_probs(logp, ent)


def shard_packed_batch(input_ids: torch.Tensor, position_ids: torch.Tensor,
                       cu_seqlens: torch.Tensor, group, tokens_multiple: int = 1
                       ) -> ContextParallelShard:
    """This rank's :class:`ContextParallelShard` of the packed batch ``input_ids [T]`` /
    ``position_ids [T]`` / ``cu_seqlens [n + 1]`` over the CP ``group``; the local token count is
    made a multiple of ``tokens_multiple`` (TP under sequence parallel)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = input_ids.device
    bounds = cu_seqlens.detach().to("cpu", torch.int64)
    lengths = bounds[1:] - bounds[:-1]
    step = 2 * size
    padded = (lengths + step - 1) // step * step
    extra = int(-int(padded.sum()) % (step * tokens_multiple))
    if extra:  # a padding-only sequence
        lengths = torch.cat([lengths, lengths.new_zeros(1)])
        padded = torch.cat([padded, padded.new_tensor([extra])])
    chunk = padded // step
    total = int(padded.sum())
    local_total = total // size
    starts = torch.cumsum(padded, 0) - padded        # global padded start of each sequence
    local_starts = starts // size                    # local start of each sequence's share
    seq = torch.repeat_interleave(torch.arange(len(padded)), padded)
    pos = torch.arange(total) - starts[seq]          # position within the padded sequence
    c = chunk[seq]
    j = pos // c.clamp(min=1)
    owner = torch.where(j < size, j, step - 1 - j)
    within = torch.where(j < size, torch.zeros_like(c), c)
    kv_order = owner * local_total + local_starts[seq] + within + pos % c.clamp(min=1)
    real = pos < lengths[seq]
    mine = torch.nonzero(owner == rank).squeeze(1)   # global rows of this rank, in local order

    ids = torch.zeros(total, dtype=input_ids.dtype, device=device)
    ids[real.to(device)] = input_ids
    positions = pos.to(device=device, dtype=position_ids.dtype)
    positions[real.to(device)] = position_ids
    local_rows = mine.to(device)

    blocks = []
    for s, (k0, cs) in enumerate(zip(starts.tolist(), chunk.tolist())):
        if cs == 0:
            continue
        q0 = int(local_starts[s])
        blocks.append(AttentionBlock(q0, cs, k0, (rank + 1) * cs))
        blocks.append(AttentionBlock(q0 + cs, cs, k0, (step - rank) * cs))
    local_lengths = 2 * chunk
    local_cu = torch.cat([local_lengths.new_zeros(1), torch.cumsum(local_lengths, 0)])
    max_position = int(position_ids.max()) + 1 if position_ids.numel() else 0
    has_next = torch.zeros(total, dtype=torch.bool)
    has_next[:-1] = real[1:] & (seq[1:] == seq[:-1])
    next_ids = torch.zeros_like(ids)
    next_ids[:-1] = ids[1:]
    has_next = has_next.to(device).index_select(0, local_rows)
    return ContextParallelShard(
        group=group, size=size, rank=rank, input_ids=ids.index_select(0, local_rows),
        position_ids=positions.index_select(0, local_rows),
        cu_seqlens=local_cu.to(device=device, dtype=torch.int32),
        max_seqlen=int(local_lengths.max()) if local_lengths.numel() else 0,
        max_position=max_position, kv_order=kv_order.to(device),
        gather_index=kv_order[real].to(device), blocks=tuple(blocks),
        next_ids=torch.where(has_next, next_ids.index_select(0, local_rows), 0),
        has_next=has_next)


def sharded_forward_hidden(model, input_ids, position_ids, cu_seqlens, kv_cache=None):
    """``ParallelModel.forward_hidden`` under CP > 1: the decoder on this rank's two chunks of
    every sequence -> ``(hidden, shard)``; the shard stands where the pad count is otherwise
    (the model's ``_head`` gathers the outputs back to the original order with it)."""
    from parallel_models.config import ConfigError

    if kv_cache is not None or model.pad_tokens_to is not None:
        raise ConfigError("parallel.context_parallel_size > 1 runs training and scoring "
                          "forwards only (no KV-cached decoding, no interleaved pipeline "
                          "schedule: virtual_pipeline_parallel_size)")
    if model.moe_aux_recording and model.config.is_moe:
        raise ConfigError("the MoE load-balancing loss is not supported with "
                          "parallel.context_parallel_size > 1: set actor.moe_aux_loss_coef=0")
    layout = model.parallel_layout
    shard = shard_packed_batch(input_ids, position_ids, cu_seqlens, layout.cp_group,
                               model.tp if model.sequence_parallel else 1)
    # the shard stands for cu_seqlens: attention reads it (layers/context_parallel.py)
    hidden = model.model(shard.input_ids, shard.position_ids, shard, shard.max_seqlen)
    return hidden, shard


__all__ = ["AttentionBlock", "ContextParallelShard", "ShardedCausalLMOutput", "all_gather_kv",
           "shard_packed_batch", "sharded_forward_hidden"]


def expert_grads_need_cp_reduction(layout) -> bool:
    """Whether routed-expert gradients must be summed over the CP group as the dense ones are
    (a plain finalize without megatron DDP). Each CP rank holds a share of one gradient; a routed
    expert's gradient already sums the shares of every rank of its expert-parallel group that
    sent it tokens. CP peers that hold the same experts (EP inside the data-parallel part):
    summed over the CP group, like dense weights. An EP group that is exactly the CP group (its
    peers hold other experts): already complete, nothing to add. Other mixes (an EP group that
    also spans data-parallel replicas) would mix replicas' data in one expert and are refused."""
    from megatron.core import parallel_state as mpu

    cp_ranks = sorted(dist.get_process_group_ranks(layout.cp_group))
    ep_group = mpu.get_expert_model_parallel_group()
    ep_ranks = sorted(dist.get_process_group_ranks(ep_group)) if ep_group is not None else []
    if len(ep_ranks) <= 1 or not set(ep_ranks) & (set(cp_ranks) - {dist.get_rank()}):
        return True
    if ep_ranks == cp_ranks:
        return False
    raise ValueError(f"expert_model_parallel_size ({len(ep_ranks)}) with context_parallel_size "
                     f"({len(cp_ranks)}): the expert-parallel group {ep_ranks} must equal the CP "
                     f"group {cp_ranks} or lie across CP groups for gradients without DDP")
