"""The outputs of continuous-batching requests: per-prompt seeds of a call
(:func:`request_seed`) and finished requests as one padded
:class:`~parallel_models.inference.generation.GenerationOutput` (:func:`generation_output`).
``continuous.py`` re-exports both."""

from __future__ import annotations

from typing import Sequence

import torch


def request_seed(seed: int | None, index: int) -> int | None:
    """The seed of prompt ``index`` of a call seeded with ``seed`` (None stays None): distinct
    prompts of one call get distinct noise."""
    return None if seed is None else (int(seed) * 1_000_003 + index) & ((1 << 62) - 1)


def generation_output(requests: Sequence, pad_token_id: int = 0):
    """A :class:`~parallel_models.inference.generation.GenerationOutput` of finished requests
    (``continuous.Request``; rows request-major, ``n`` per request)."""
    from parallel_models.inference.generation import GenerationOutput

    pairs = [(req.prompt, s) for req in requests for s in req.samples]
    rows = len(pairs)
    p_max = max(len(p) for p, _ in pairs)
    r_max = max(max(len(s.token_ids) for _, s in pairs), 1)
    prompts = torch.full((rows, p_max), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, p_max), dtype=torch.long)
    responses = torch.full((rows, r_max), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((rows, r_max), dtype=torch.long)
    log_probs = torch.zeros((rows, r_max), dtype=torch.float32)
    k = max(req.top_logprobs for req in requests)
    top_ids = torch.zeros((rows, r_max, k), dtype=torch.long) if k else None
    top_vals = torch.zeros((rows, r_max, k), dtype=torch.float32) if k else None
    for b, (p, s) in enumerate(pairs):
        prompts[b, p_max - len(p):] = torch.tensor(p)
        prompt_mask[b, p_max - len(p):] = 1
        n = len(s.token_ids)
        responses[b, :n] = torch.tensor(s.token_ids)
        response_mask[b, :n] = 1
        log_probs[b, :n] = torch.tensor(s.log_probs)
        if k and s.top_logprobs:
            top = torch.tensor(s.top_logprobs)  # [n, k', 2]
            top_ids[b, :n, :top.shape[1]] = top[..., 0].long()
            top_vals[b, :n, :top.shape[1]] = top[..., 1]
    return GenerationOutput(prompts=prompts, prompt_mask=prompt_mask, responses=responses,
                            response_mask=response_mask, log_probs=log_probs,
                            top_token_ids=top_ids, top_log_probs=top_vals)


__all__ = ["generation_output", "request_seed"]
