"""The exact-mode versions of the model's own kernels, called by its hooks while
``mode.enabled()``: RMSNorm, causal attention (packed prefill / training, and decode from a KV
cache) and next-token log-probs (rollout sampling and the training loss read the same kernel).
Each has the ordinary op's gradient (``mode.with_reference_grad``)."""

from __future__ import annotations

import torch

from parallel_models.llama.layers.exact.mode import with_reference_grad


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, reference=None) -> torch.Tensor:
    """``reference(x, weight, eps)``: the ordinary op (its gradient is used; None: no grad)."""
    from parallel_models.llama.layers.exact import triton_rows

    return with_reference_grad(lambda x, w: triton_rows.rms_norm(x, w, eps),
                               reference and (lambda x, w: reference(x, w, eps)), x, weight)


def varlen_attention(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale=None,
                     reference=None):
    """Causal attention of packed sequences (``cu_seqlens``): prefill and training.
    ``reference``: the ordinary kernel, same arguments (its gradient is used; None: no grad)."""
    from parallel_models.llama.layers.exact import triton_attention

    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)

    def exact(q, k, v):
        return triton_attention.attention(q, k.contiguous(), v.contiguous(), cu,
                                          torch.zeros_like(cu[:-1]), cu[:-1], max_seqlen, scale)

    return with_reference_grad(
        exact, reference and (lambda q, k, v: reference(q, k, v, cu, max_seqlen, scale)),
        q, k, v)


def decode_attention(q, k_pool, v_pool, starts: torch.Tensor, lengths: torch.Tensor, scale=None):
    """One query per row (``q [B, heads, d]``) at position ``lengths[b]``, its keys at rows
    ``starts[b] + 0..lengths[b]`` of ``k_pool`` / ``v_pool`` ``[S, kv_heads, d]`` (no grad)."""
    from parallel_models.llama.layers.exact import triton_attention

    b = q.shape[0]
    q_start = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    return triton_attention.attention(q, k_pool, v_pool, q_start, lengths, starts, 1, scale)


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0):
    """float32 ``log_softmax(logits.float() / temperature)`` at ``labels``, one per row. Pass the
    model's logits as they are (not a float copy) on both sides: one dtype, one compiled kernel."""
    from parallel_models.llama.layers.exact import triton_rows

    def reference(x):
        logp = torch.log_softmax(x.float() / temperature, -1)
        return logp.gather(-1, labels.reshape(*x.shape[:-1], 1).long()).squeeze(-1)

    return with_reference_grad(lambda x: triton_rows.token_log_probs(x, labels, temperature),
                               reference, logits)


def packed_next_token_log_probs(logits, input_ids, cu_seqlens, temperature: float = 1.0):
    """:func:`parallel_models.utils.vocab_parallel.log_probs_from_packed_logits` with the exact
    kernel: ``logits [T, V]`` of the full vocab (the caller gathers them under TP)."""
    from parallel_models.utils.vocab_parallel import packed_next_token_mask

    labels = torch.roll(input_ids, shifts=-1)
    mask = packed_next_token_mask(cu_seqlens, input_ids.shape[0])
    logp = token_log_probs(logits, labels, temperature)
    return torch.where(mask, logp, torch.zeros_like(logp))
