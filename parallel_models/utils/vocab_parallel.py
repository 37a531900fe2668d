"""Log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds ``logits[..., V_local]`` for its vocab slice
``[rank * V_local, (rank + 1) * V_local)`` (``V_local = padded_vocab / tp``, as produced by
:class:`parallel_models.heads.lm_head.ParallelLMHead`, whose padding rows on the last rank hold
``torch.finfo(dtype).min``). The softmax statistics are combined with two all-reduces over the
TP group per call (one MAX, then one SUM of ``[sum exp, sum exp * z, target logit]`` stacked),
and the backward is analytic and local (it needs no communication)::

    s        = z - max_global(z)                       (float32, <= 0)
    Z        = sum_global exp(s),  p = exp(s) / Z
    log p(y) = s_y - log Z
    H        = log Z - sum_global p * s               (= logsumexp(z) - sum p * z)

    d log p(y) / dz = onehot(y) - p
    d H / dz        = -p * (s - sum p * s)            (= -p * (z - E_p[z]))

Everything is computed in float32 whatever the input dtype (bf16/fp16/fp32; float64 input is
kept in float64); outputs are float32 and gradients are cast back to the input dtype. ``-inf``
and ``finfo.min`` logits get probability 0 and gradient 0 (no NaN/inf). Labels must lie in
``[0, vocab_size)``: a label no rank owns (e.g. -100) yields a meaningless finite value, so mask
such positions yourself (the RmPad helper below does).

``group`` defaults to the TP group of the training layout (``init_parallel``'s, megatron-core's
tensor-model-parallel group); pass a model's own (``model.parallel_layout.tp_group``) for a
model built in another layout. With ``group=None`` and
torch.distributed not initialized (or a group of one rank) the plain local math is used, so
everything works at TP=1 in a single process.

RmPad (packed) helpers:

* :func:`log_probs_from_packed_logits` — per-token log-prob of the *next* token of the same
  sequence from packed ``[T, V_local]`` logits (0 at each sequence's last token);
* :func:`packed_next_token_mask` — where those values are defined;
* :func:`gather_response` / :func:`response_mask` — cut a padded ``[B, R]`` response block out of
  packed per-token outputs laid out as ``prompt_i + response_i`` per sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist

from parallel_models.utils.gpu_compile import compiled_on_gpu

__all__ = [
    "vocab_parallel_log_probs",
    "vocab_parallel_entropy",
    "vocab_parallel_log_probs_and_entropy",
    "log_probs_from_packed_logits",
    "packed_next_token_mask",
    "gather_response",
    "response_mask",
]

def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for every input dtype except float64, which is kept (exact gradchecks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _resolve_group(group):
    """The TP group to reduce over, or None for local math (a single rank)."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        from parallel_models import distributed as pm_dist

        if not pm_dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is initialized but megatron-core's model-parallel groups are "
                "not: call parallel_models.init_parallel(...) or pass group= explicitly")
        group = pm_dist.training_layout().tp_group
    if dist.get_world_size(group) == 1:
        return None
    return group


def _vocab_start(group, local_vocab: int) -> int:
    return 0 if group is None else dist.get_rank(group) * local_vocab


def _shifted(z: torch.Tensor, max_z: torch.Tensor) -> torch.Tensor:
    """``z - max``, with -inf (banned tokens) clamped to finfo.min so that ``exp(s) * s`` is 0
    rather than NaN. Always returns a fresh tensor (safe to modify in place)."""
    return torch.sub(z, max_z.unsqueeze(-1)).clamp_(min=torch.finfo(z.dtype).min)


@dataclasses.dataclass
class SoftmaxStats:
    """What :func:`softmax_stats` found for rows of vocab-parallel logits: the outputs
    (``log_probs`` / ``entropy``, float32, None where not asked for) and what
    :func:`logits_grad` needs to recompute the softmax from the same logits."""

    log_probs: torch.Tensor | None
    entropy: torch.Tensor | None
    max_z: torch.Tensor
    sum_exp: torch.Tensor
    mean_s: torch.Tensor | None
    in_range: torch.Tensor | None
    idx: torch.Tensor | None


def softmax_stats(logits, labels, group, need_entropy: bool, temperature: float) -> SoftmaxStats:
    """The forward math of the vocab-parallel log-prob / entropy (module docstring) on
    ``logits [..., V_local]``: two all-reduces over ``group`` (None: local)."""
    need_logp = labels is not None
    t = float(temperature)
    max_z = _row_max(logits, t)
    if group is not None:
        dist.all_reduce(max_z, op=dist.ReduceOp.MAX, group=group)
    in_range = idx = None
    if need_logp:
        local = labels.long() - _vocab_start(group, logits.shape[-1])
        stats, in_range, idx = _row_stats_with_target(logits, max_z, local, need_entropy, t)
    else:
        stats = _row_stats(logits, max_z, need_entropy, t)
    if group is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    sum_exp = stats[..., 0]
    log_z = sum_exp.log()
    log_probs = entropy = mean_s = None
    if need_entropy:
        mean_s = stats[..., 1] / sum_exp  # E_p[s] (<= 0)
        entropy = log_z - mean_s
    if need_logp:
        log_probs = stats[..., -1] - max_z - log_z
    return SoftmaxStats(log_probs, entropy, max_z, sum_exp, mean_s, in_range, idx)


def logits_grad(logits, stats: SoftmaxStats, grad_logp, grad_ent, temperature: float):
    """d/dlogits of ``sum(grad_logp * log_probs + grad_ent * entropy)`` (either grad may be
    None, not both), in the logits' dtype; local (no communication)."""
    t = float(temperature)
    if grad_ent is None:
        return _logp_grad(logits, stats.max_z, stats.sum_exp, grad_logp, stats.in_range,
                          stats.idx, t)
    if grad_logp is None:
        return _entropy_grad(logits, stats.max_z, stats.sum_exp, stats.mean_s, grad_ent, t)
    return _logp_entropy_grad(logits, stats.max_z, stats.sum_exp, stats.mean_s, grad_logp,
                              grad_ent, stats.in_range, stats.idx, t)


class _VocabParallelLogProbsEntropy(torch.autograd.Function):
    """Forward returns ``(log_probs or None, entropy or None)``, float32 (float64 for float64
    input), shape ``logits.shape[:-1]``; backward is local (no communication)."""

    @staticmethod
    def forward(ctx, logits, labels, group, need_entropy, temperature=1.0):
        stats = softmax_stats(logits, labels, group, need_entropy, temperature)
        ctx.save_for_backward(logits, stats.max_z, stats.sum_exp, stats.mean_s, stats.in_range,
                              stats.idx)
        ctx.temperature = float(temperature)
        ctx.set_materialize_grads(False)
        return stats.log_probs, stats.entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_ent):
        logits, max_z, sum_exp, mean_s, in_range, idx = ctx.saved_tensors
        if grad_logp is None and grad_ent is None:
            return None, None, None, None, None
        stats = SoftmaxStats(None, None, max_z, sum_exp, mean_s, in_range, idx)
        return logits_grad(logits, stats, grad_logp, grad_ent, ctx.temperature), \
            None, None, None, None


# The local [..., V] math below is pure elementwise/reduction work: on CUDA each function runs
# compiled (one or two fused passes over the logits instead of ~8 float32 passes).

def _scaled(logits, temperature: float):
    """``logits / temperature`` in the compute dtype (upcast first, as the sampler does:
    dividing bf16 logits would round the scaled logits to bf16)."""
    z = logits.to(_compute_dtype(logits.dtype))
    return z if temperature == 1.0 else z / temperature


@compiled_on_gpu
def _row_max(logits, temperature: float):
    return _scaled(logits, temperature).amax(dim=-1)


def _sum_exp_parts(z, max_z, need_entropy: bool) -> list[torch.Tensor]:
    s = _shifted(z, max_z)
    e = torch.exp(s)
    parts = [e.sum(dim=-1)]
    if need_entropy:
        parts.append(s.mul_(e).sum(dim=-1))  # sum exp(s) * s; 0 * finfo.min = 0
    return parts  # s and e are not kept: backward recomputes them from the saved logits


@compiled_on_gpu
def _row_stats(logits, max_z, need_entropy: bool, temperature: float):
    z = _scaled(logits, temperature)
    return torch.stack(_sum_exp_parts(z, max_z, need_entropy), dim=-1)


@compiled_on_gpu
def _row_stats_with_target(logits, max_z, local_labels, need_entropy: bool, temperature: float):
    """Stats plus the target logit of labels this rank owns (``local_labels`` = label - start)."""
    z = _scaled(logits, temperature)
    parts = _sum_exp_parts(z, max_z, need_entropy)
    local_vocab = z.shape[-1]
    in_range = (local_labels >= 0) & (local_labels < local_vocab)
    idx = local_labels.clamp(0, local_vocab - 1).unsqueeze(-1)
    target = z.gather(-1, idx).squeeze(-1)
    parts.append(torch.where(in_range, target, torch.zeros_like(target)))
    return torch.stack(parts, dim=-1), in_range, idx


def _softmax(logits, max_z, sum_exp, temperature: float):
    z = _scaled(logits, temperature)
    s = _shifted(z, max_z)
    return s, torch.exp(s).div_(sum_exp.unsqueeze(-1))


def _unscaled(grad_z, temperature: float, logits):
    """d/dlogits from d/dz for ``z = logits / temperature``, in the logits' dtype."""
    return (grad_z if temperature == 1.0 else grad_z.div_(temperature)).to(logits.dtype)


def _add_target_grad(grad, grad_logp, in_range, idx):
    g = grad_logp.to(grad.dtype)
    hit = torch.where(in_range, g, torch.zeros_like(g))
    return grad.scatter_add_(-1, idx, hit.unsqueeze(-1))


# d/dz [g_lp * log p(y) + g_H * H] = g_lp * onehot(y) - p * g_lp - p * (s - E_p[s]) * g_H.
# p multiplies (s - E) before g_H does: s - E can be ~finfo.min at padding rows, where p = 0, and
# scaling it by |g_H| > 1 first would overflow to inf (then 0 * inf = NaN).

@compiled_on_gpu
def _logp_grad(logits, max_z, sum_exp, grad_logp, in_range, idx, temperature: float):
    _, p = _softmax(logits, max_z, sum_exp, temperature)
    grad = p.mul_(grad_logp.to(p.dtype).unsqueeze(-1)).neg_()
    return _unscaled(_add_target_grad(grad, grad_logp, in_range, idx), temperature, logits)


def _entropy_grad_part(s, p, mean_s, grad_ent):
    return s.sub_(mean_s.unsqueeze(-1)).mul_(p).mul_(grad_ent.to(p.dtype).unsqueeze(-1))


@compiled_on_gpu
def _entropy_grad(logits, max_z, sum_exp, mean_s, grad_ent, temperature: float):
    s, p = _softmax(logits, max_z, sum_exp, temperature)
    return _unscaled(_entropy_grad_part(s, p, mean_s, grad_ent).neg_(), temperature, logits)


@compiled_on_gpu
def _logp_entropy_grad(logits, max_z, sum_exp, mean_s, grad_logp, grad_ent, in_range, idx,
                       temperature: float):
    s, p = _softmax(logits, max_z, sum_exp, temperature)
    grad = _entropy_grad_part(s, p, mean_s, grad_ent)
    grad.add_(p.mul_(grad_logp.to(p.dtype).unsqueeze(-1))).neg_()
    return _unscaled(_add_target_grad(grad, grad_logp, in_range, idx), temperature, logits)


def _check(logits: torch.Tensor, labels: torch.Tensor | None, temperature: float = 1.0):
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError("logits need a non-empty last (vocab) dimension, got "
                         f"{tuple(logits.shape)}")
    if labels is not None:
        if labels.shape != logits.shape[:-1]:
            raise ValueError(f"labels {tuple(labels.shape)} must match logits "
                             f"{tuple(logits.shape)} without the vocab dimension")
        if labels.is_floating_point():
            raise TypeError(f"labels must be integer token ids, got {labels.dtype}")


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, group=None, *,
                             temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(full logits / temperature)[label]`` per position, float32
    ``logits.shape[:-1]``.

    ``logits [..., V_local]`` is this rank's vocab slice; ``labels [...]`` are global token ids.
    Gradient w.r.t. the local logits: ``(onehot_local(label) - softmax_local) * grad / T``.
    The logits are divided by ``temperature`` after the upcast to float32, as the sampler does.
    """
    _check(logits, labels, temperature)
    logp, _ = _VocabParallelLogProbsEntropy.apply(logits, labels, _resolve_group(group), False,
                                                  temperature)
    return logp


def vocab_parallel_entropy(logits: torch.Tensor, group=None) -> torch.Tensor:
    """Entropy of ``softmax(full logits)`` per position, float32 ``logits.shape[:-1]``.

    ``H = logsumexp(z) - sum(p * z)``; gradient ``dH/dz = -p * (z - sum(p * z))``.
    """
    _check(logits, None)
    _, ent = _VocabParallelLogProbsEntropy.apply(logits, None, _resolve_group(group), True)
    return ent


def vocab_parallel_log_probs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, group=None,
                                         *, temperature: float = 1.0
                                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Both of the above in one pass (two all-reduces in all): ``(log_probs, entropy)``, of
    ``softmax(logits / temperature)``."""
    _check(logits, labels, temperature)
    return _VocabParallelLogProbsEntropy.apply(logits, labels, _resolve_group(group), True,
                                               temperature)


# ---- RmPad (packed) helpers ------------------------------------------------------------------

def packed_next_token_mask(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Bool ``[total]``: True where packed token ``t`` has a next token in its own sequence.

    False at the last token of every sequence and past ``cu_seqlens[-1]`` (trailing padding).
    ``total`` defaults to ``cu_seqlens[-1]``.
    """
    cu = cu_seqlens.long()
    if total is None:
        total = int(cu[-1])
    # one spare slot takes the writes of empty sequences and of ends past ``total``: no boolean
    # indexing, so no device-to-host sync (a sync drains the GPU's queue mid-step)
    mask = torch.arange(total + 1, device=cu.device) < cu[-1]  # tokens inside some sequence
    ends = cu[1:] - 1
    ends = torch.where((cu[1:] > cu[:-1]) & (ends < total), ends, total)
    mask[ends] = False
    return mask[:total]


def log_probs_from_packed_logits(logits: torch.Tensor, input_ids: torch.Tensor,
                                 cu_seqlens: torch.Tensor, group=None, *,
                                 with_entropy: bool = False, temperature: float = 1.0):
    """Next-token log-probs of a packed (RmPad) batch from vocab-parallel logits.

    ``logits [T, V_local]`` (this rank's vocab slice), ``input_ids [T]``, ``cu_seqlens [B + 1]``.
    Returns float32 ``[T]`` with ``out[t] = log p(input_ids[t + 1] | tokens <= t)`` when ``t + 1``
    is in the same sequence as ``t``, and 0 (no gradient) at the last token of each sequence
    (see :func:`packed_next_token_mask`). With ``with_entropy=True`` returns
    ``(log_probs, entropy)``, where ``entropy[t]`` is the entropy of the distribution at ``t``
    (defined at every token, including the last), computed in the same pass. Both are of
    ``softmax(logits / temperature)``, divided in float32 (as the sampler does).
    """
    if logits.dim() != 2 or input_ids.dim() != 1 or logits.shape[0] != input_ids.shape[0]:
        raise ValueError(f"expected logits [T, V_local] and input_ids [T], got "
                         f"{tuple(logits.shape)} and {tuple(input_ids.shape)}")
    labels = torch.roll(input_ids, shifts=-1)  # a valid id everywhere; masked below
    mask = packed_next_token_mask(cu_seqlens, input_ids.shape[0])
    if with_entropy:
        logp, ent = vocab_parallel_log_probs_and_entropy(logits, labels, group,
                                                         temperature=temperature)
    else:
        logp = vocab_parallel_log_probs(logits, labels, group, temperature=temperature)
        ent = None
    logp = torch.where(mask, logp, torch.zeros_like(logp))
    return (logp, ent) if with_entropy else logp


def _response_index(cu_seqlens, prompt_lengths, response_length: int, shift: int):
    cu = cu_seqlens.long()
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    if not torch.is_tensor(prompt_lengths):
        prompt_lengths = torch.tensor(list(prompt_lengths), dtype=torch.long)
    prompt = prompt_lengths.to(device=cu.device, dtype=torch.long).flatten()
    if prompt.numel() != starts.numel():
        raise ValueError(f"prompt_lengths has {prompt.numel()} entries for "
                         f"{starts.numel()} packed sequences")
    resp = lengths - prompt
    if response_length < 0 or shift < 0:
        raise ValueError("response_length and shift must be >= 0")
    bad = (resp < 0) | (resp > response_length) | (prompt < shift)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"sequence {i}: length {int(lengths[i])} with prompt length {int(prompt[i])} does not "
            f"fit prompt + response (0..{response_length} tokens) with shift={shift} "
            f"(needs prompt_length >= shift)")
    j = torch.arange(response_length, device=cu.device)
    valid = j.unsqueeze(0) < resp.unsqueeze(1)  # [B, R]
    index = (starts + prompt - shift).unsqueeze(1) + j.unsqueeze(0)
    return torch.where(valid, index, torch.zeros_like(index)), valid


def response_mask(cu_seqlens: torch.Tensor, prompt_lengths, response_length: int) -> torch.Tensor:
    """Bool ``[B, R]``: True for the response tokens each packed sequence actually has
    (``seqlen_i - prompt_lengths[i]`` of them, right-padded to ``response_length``)."""
    _, valid = _response_index(cu_seqlens, prompt_lengths, response_length, 0)
    return valid


def gather_response(packed_values: torch.Tensor, cu_seqlens: torch.Tensor,
                    prompt_lengths: torch.Tensor | Sequence[int], response_length: int, *,
                    shift: int = 1, fill_value: float = 0.0) -> torch.Tensor:
    """Packed per-token outputs -> a right-padded response block ``[B, R, ...]``.

    Layout: packed sequence ``i`` (``cu_seqlens[i]:cu_seqlens[i+1]``) is its prompt
    (``prompt_lengths[i]`` tokens) followed by its response (the remaining
    ``seqlen_i - prompt_lengths[i] <= response_length`` tokens, no padding in between).
    ``out[i, j]`` is the value for response token ``j`` of sequence ``i``, read at packed position
    ``cu_seqlens[i] + prompt_lengths[i] + j - shift``:

    * ``shift=1`` (default) for next-token-aligned outputs, where position ``t`` describes the
      prediction of token ``t + 1``: :func:`log_probs_from_packed_logits`, the entropy, and PPO
      critic values (the value of the state before each response token);
    * ``shift=0`` for outputs that belong to the token at the same position.

    Missing response slots (``j >= seqlen_i - prompt_lengths[i]``) hold ``fill_value`` and get
    no gradient; :func:`response_mask` gives the matching mask. Differentiable w.r.t.
    ``packed_values``. Raises ``ValueError`` for a response longer than ``response_length`` or a
    prompt shorter than ``shift`` (this check syncs with the device once).
    """
    index, valid = _response_index(cu_seqlens, prompt_lengths, response_length, shift)
    out = packed_values[index]  # [B, R, ...]
    mask = valid.view(*valid.shape, *([1] * (packed_values.dim() - 1)))
    return torch.where(mask, out, torch.full((), fill_value, dtype=out.dtype, device=out.device))
