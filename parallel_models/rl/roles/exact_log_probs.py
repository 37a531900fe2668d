"""Exact mode (``rollout.exact``) on the training side: the response log-probs of a packed
microbatch from the same batch-invariant kernel the rollout sampler used
(``llama/layers/exact``), so old-log-prob, reference and update forwards reproduce the rollout's
log-probs bit for bit. Under TP the vocab-parallel logits are gathered first (the sampler sees
the full vocab too); the entropy, which nothing compares, comes from the ordinary path."""

from __future__ import annotations

import torch

from parallel_models.utils.vocab_parallel import gather_response, log_probs_from_packed_logits


def _full_vocab(logits: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if not mpu.model_parallel_is_initialized() or mpu.get_tensor_model_parallel_world_size() == 1:
        return logits
    return gather_from_tensor_model_parallel_region(logits)


def exact_response_log_probs(logits, mb, temperature: float, with_entropy: bool):
    """``(log_probs [B, R], entropy [B, R] or None)`` of microbatch ``mb`` (``roles``'s
    ``_response_log_probs`` in exact mode)."""
    from parallel_models.llama.layers.exact import ops

    logp = ops.packed_next_token_log_probs(_full_vocab(logits), mb["input_ids"],
                                           mb["cu_seqlens"], temperature)
    R = mb["response_mask"].shape[1]
    out = gather_response(logp, mb["cu_seqlens"], mb["prompt_lengths"], R)
    if not with_entropy:
        return out, None
    _, ent = log_probs_from_packed_logits(logits, mb["input_ids"], mb["cu_seqlens"],
                                          with_entropy=True, temperature=temperature)
    return out, gather_response(ent, mb["cu_seqlens"], mb["prompt_lengths"], R)
