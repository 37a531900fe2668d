"""The trainer's rollout dict from per-sample answers: the rollout server's ``/generate`` answer,
or the same shape gathered by the hybrid engine (``hybrid.py``) from its rollout ranks.

:func:`batch_from_response` lays the rows out as the PPO batch wants them (prompt-major, ``n``
samples per prompt): ``sequences`` = left-padded prompts + right-padded responses,
``attention_mask``, ``prompt_lengths``, ``response_mask``, ``group_index``, the sampler's
``rollout_log_probs``, the answer's ``weight_version`` and, when the samples carry them (MoE),
``routes`` (compact, ``parallel_models.utils.routes``).
"""

from __future__ import annotations

import torch


def _routes_tensor(prompts, samples, p_max: int, r_max: int, num_experts: int | None):
    """The samples' ``routes`` lists as ``[rows, P + R, layers, k]`` (compact), aligned with
    the batch's left-padded prompts and right-padded responses."""
    from parallel_models.utils import routes as route_utils

    first = torch.tensor(samples[0]["routes"])
    full = torch.full((len(samples), p_max + r_max, *first.shape[1:]), route_utils.MISSING,
                      dtype=torch.long)
    for b, (p, s) in enumerate(zip(prompts, samples)):
        r = torch.tensor(s["routes"], dtype=torch.long)
        full[b, p_max - len(p):p_max - len(p) + r.shape[0]] = r
    experts = num_experts if num_experts is not None else int(full.max()) + 1
    return route_utils.compact(full, experts)


def batch_from_response(resp: dict, n: int, pad_token_id: int = 0,
                        num_experts: int | None = None) -> dict:
    """The trainer's rollout dict from a /generate answer (rows: prompt-major, n per prompt)."""
    prompts, samples = [], []
    for r in resp["results"]:
        for s in r["samples"]:
            prompts.append(r["prompt_token_ids"])
            samples.append(s)
    rows = len(prompts)
    p_max = max(len(p) for p in prompts)
    r_max = max(max(len(s["token_ids"]) for s in samples), 1)
    seq = torch.full((rows, p_max + r_max), pad_token_id, dtype=torch.long)
    mask = torch.zeros((rows, p_max + r_max), dtype=torch.long)
    logp = torch.zeros((rows, r_max), dtype=torch.float32)
    for b, (p, s) in enumerate(zip(prompts, samples)):
        seq[b, p_max - len(p):p_max] = torch.tensor(p)
        mask[b, p_max - len(p):p_max] = 1
        k = len(s["token_ids"])
        if k:
            seq[b, p_max:p_max + k] = torch.tensor(s["token_ids"])
            mask[b, p_max:p_max + k] = 1
            logp[b, :k] = torch.tensor(s["log_probs"])
    out = {"sequences": seq, "attention_mask": mask,
           "prompt_lengths": mask[:, :p_max].sum(-1), "response_mask": mask[:, p_max:].clone(),
           "group_index": torch.arange(len(resp["results"])).repeat_interleave(n),
           "rollout_log_probs": logp, "weight_version": resp["weight_version"]}
    if samples and "routes" in samples[0]:
        out["routes"] = _routes_tensor(prompts, samples, p_max, r_max, num_experts)
    return out


__all__ = ["batch_from_response"]
