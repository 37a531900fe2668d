"""Log-probs (and entropy) straight from the LM head's input, a chunk of tokens at a time.

The rank's ``[tokens, V_local]`` logits are never held whole, neither in the forward nor in the
backward.

The unchunked path (``ParallelLMHead`` then :mod:`parallel_models.utils.vocab_parallel`) keeps the
logits ``[T, V_local]`` for the backward and makes a gradient of the same size (plus float32
temporaries of it): at the Llama-3-8B vocabulary (128,256) and the 16,384 tokens of one
context-parallel rank of a 32k-token sequence that is 4 GiB of bf16 logits, 4 GiB of their
gradient and up to 8 GiB per float32 temporary. Here :class:`_ChunkedHeadLogProbs` keeps only
the head's input ``[T, H]`` and per-token softmax statistics ``[T]``:

- forward: for each chunk of ``chunk_tokens`` rows, the logits ``hidden_c @ W^T`` (the matmul of
  megatron's ``ColumnParallelLinear``, the padding vocab rows filled with ``finfo.min`` as
  ``ParallelLMHead`` does), then the vocab-parallel statistics of
  :func:`~parallel_models.utils.vocab_parallel.softmax_stats` (two all-reduces over the TP group
  per chunk);
- backward: for each chunk the logits again, their gradient from the saved statistics
  (:func:`~parallel_models.utils.vocab_parallel.logits_grad`, the same math), then
  ``grad_hidden_c = g_c @ W`` and ``grad_W += g_c^T @ hidden_c``; ``grad_W`` is summed over the
  chunks in float32 (on CUDA by the mixed-dtype GEMM of ``utils/wgrad_fusion`` where it works)
  and cast to the weight's dtype once.

The same values as the unchunked path (float32 on the CPU: equal to rounding of the chunked
weight-gradient sum, rel <= 1e-6; the tests check it), at one more head GEMM in the backward.
:func:`chunk_tokens_for` sizes the chunks (:data:`LOGITS_CHUNK_BYTES` of float32 logits each);
callers use the unchunked path when all tokens fit one chunk (:func:`worth_chunking`): there
it is as fast and bit-identical to before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel_models.utils.vocab_parallel import (SoftmaxStats, _compute_dtype, _resolve_group,
                                                  logits_grad, softmax_stats)

# float32 bytes of one chunk's logits (the backward's largest temporaries are a few of these)
LOGITS_CHUNK_BYTES = 1 << 29

__all__ = ["LOGITS_CHUNK_BYTES", "chunk_tokens_for", "chunked_head_log_probs", "worth_chunking"]


def chunk_tokens_for(local_vocab: int) -> int:
    """Tokens per chunk: :data:`LOGITS_CHUNK_BYTES` of float32 logits, rounded down to a
    multiple of 64 rows where that is at least 64 (at least 1): 1,024 at the Llama-3 vocabulary
    on one TP rank."""
    rows = LOGITS_CHUNK_BYTES // (4 * max(local_vocab, 1))
    return rows // 64 * 64 if rows >= 64 else max(rows, 1)


def worth_chunking(tokens: int, local_vocab: int) -> bool:
    """Whether ``tokens`` rows of logits span more than one chunk."""
    return tokens > chunk_tokens_for(local_vocab)


def _chunk_logits(hidden, weight, pad):
    """``hidden [c, 1, H] -> [c, V_local]`` as ``ParallelLMHead`` computes it."""
    logits = torch.matmul(hidden, weight.t()).squeeze(1)
    return logits if pad is None else logits.masked_fill(pad, torch.finfo(logits.dtype).min)


def _rows(x, a: int, b: int):
    return None if x is None else x[a:b]


def _add_weight_grad(acc, grad_logits, hidden):
    """``acc += grad_logits^T @ hidden`` into the float32 (float64) accumulator ``acc``."""
    from parallel_models.utils import wgrad_fusion

    if hidden.dtype == acc.dtype:
        acc.addmm_(grad_logits.t(), hidden)
    elif acc.is_cuda and wgrad_fusion.fused_gemm_works("cuda", hidden.dtype):
        wgrad_fusion.extension.wgrad_gemm_accum_fp32(hidden, grad_logits, acc)
    else:
        acc.add_(grad_logits.t() @ hidden)


class _ChunkedHeadLogProbs(torch.autograd.Function):
    """``(hidden [T, 1, H], weight [V_local, H], labels [T])`` -> ``(log_probs [T], entropy [T]
    or None)``, float32; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, group, need_entropy, temperature, chunk, num_real):
        local_vocab = weight.shape[0]
        pad = None
        if num_real < local_vocab:
            pad = torch.arange(local_vocab, device=hidden.device) >= num_real
        parts = []
        for a in range(0, hidden.shape[0], chunk):
            b = min(a + chunk, hidden.shape[0])
            logits = _chunk_logits(hidden[a:b], weight, pad)
            parts.append(softmax_stats(logits, labels[a:b], group, need_entropy, temperature))
            del logits

        def cat(name):
            return None if getattr(parts[0], name) is None else \
                torch.cat([getattr(p, name) for p in parts])

        stats = SoftmaxStats(*(cat(f) for f in ("log_probs", "entropy", "max_z", "sum_exp",
                                                "mean_s", "in_range", "idx")))
        ctx.save_for_backward(hidden, weight, pad, stats.max_z, stats.sum_exp, stats.mean_s,
                              stats.in_range, stats.idx)
        ctx.temperature, ctx.chunk = float(temperature), chunk
        ctx.set_materialize_grads(False)
        return stats.log_probs, stats.entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, pad, max_z, sum_exp, mean_s, in_range, idx = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logp is None and grad_ent is None) or not (need_hidden or need_weight):
            return (None,) * 8
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        acc = None
        if need_weight:
            acc = torch.zeros(weight.shape, dtype=_compute_dtype(weight.dtype),
                              device=weight.device)
        for a in range(0, hidden.shape[0], ctx.chunk):
            b = min(a + ctx.chunk, hidden.shape[0])
            h = hidden[a:b]
            logits = _chunk_logits(h, weight, pad)
            stats = SoftmaxStats(None, None, max_z[a:b], sum_exp[a:b], _rows(mean_s, a, b),
                                 _rows(in_range, a, b), _rows(idx, a, b))
            grad = logits_grad(logits, stats, _rows(grad_logp, a, b), _rows(grad_ent, a, b),
                               ctx.temperature)
            del logits
            if pad is not None:  # masked_fill's backward
                grad.masked_fill_(pad, 0)
            if need_hidden:  # megatron's linear: grad_output.matmul(weight)
                grad_hidden[a:b] = grad.matmul(weight).unsqueeze(1)
            if need_weight:
                _add_weight_grad(acc, grad, h.squeeze(1))
            del grad
        grad_weight = None
        if need_weight:
            grad_weight = acc if acc.dtype == weight.dtype else acc.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _enter_tp_region(hidden, proj):
    """What ``ColumnParallelLinear`` does to its input: all-gather the tokens under sequence
    parallelism (backward: reduce-scatter), else at TP > 1 an identity whose backward
    all-reduces the input gradient."""
    from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                               gather_from_sequence_parallel_region)

    group = proj.tp_group
    if group is None or dist.get_world_size(group) == 1:
        return hidden
    if proj.sequence_parallel:
        return gather_from_sequence_parallel_region(hidden, True, group=group)
    return copy_to_tensor_model_parallel_region(hidden, group=group)


def chunked_head_log_probs(hidden: torch.Tensor, lm_head, labels: torch.Tensor, *,
                           weight: torch.Tensor | None = None, with_entropy: bool = False,
                           temperature: float = 1.0, chunk_tokens: int | None = None):
    """``log softmax(lm_head(hidden) / temperature)[labels]`` per token (float32 ``[T]``), and
    with ``with_entropy`` the entropy of that distribution, as ``(log_probs, entropy)``.

    ``hidden [T(/tp under sequence parallel), 1, H]``: the final (normed) hidden states that
    ``lm_head`` (a :class:`~parallel_models.heads.lm_head.ParallelLMHead`) would project;
    ``weight``: the tied embedding weight when the head has none of its own; ``labels [T]``:
    global token ids (every value must be a real id); ``chunk_tokens``: rows per chunk (default
    :func:`chunk_tokens_for` of the head's vocab slice). Gradients reach ``hidden`` and the
    weight as through the head and the vocab-parallel log-prob."""
    proj = lm_head.proj
    weight = proj.weight if weight is None else weight
    if hidden.dim() != 3 or hidden.shape[1] != 1:
        raise ValueError(f"hidden must be [tokens, 1, hidden], got {tuple(hidden.shape)}")
    hidden = _enter_tp_region(hidden, proj)
    if labels.shape != hidden.shape[:1] or labels.is_floating_point():
        raise ValueError(f"labels must be integer token ids [{hidden.shape[0]}], got "
                         f"{labels.dtype} {tuple(labels.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = chunk_tokens or chunk_tokens_for(weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _ChunkedHeadLogProbs.apply(hidden, weight, labels, _resolve_group(proj.tp_group),
                                      with_entropy, temperature, chunk, lm_head.num_real)
