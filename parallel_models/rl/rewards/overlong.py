"""DAPO's overlong reward shaping (Yu et al. 2025, "DAPO: an open-source LLM reinforcement
learning system at scale", arXiv:2503.14476, section 3.4, "soft overlong punishment").

With ``L_max = rollout.max_new_tokens``, a buffer of ``L_cache = reward.overlong_buffer.len``
tokens and ``|y|`` the response's length in tokens (its EOS included), the reward gets::

    penalty(y) = min(-(|y| - (L_max - L_cache)) / L_cache * penalty_factor, 0)

0 up to ``L_max - L_cache`` tokens, then falling linearly to ``-penalty_factor`` at ``L_max``
(verl 0.9.1's ``DAPORewardManager``: ``verl/workers/reward_manager/dapo.py``). The trainer adds
it to the training rewards (every reward type; the validation score is left unshaped, it
measures the task) and logs ``reward/overlong_penalty`` (mean over responses) and
``reward/overlong_share`` (responses with a penalty).
"""

from __future__ import annotations

import torch

from parallel_models.rl.observe import dp_stats


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """The penalty (<= 0) of each response of ``response_lengths`` tokens (float32)."""
    if buffer_len <= 0:
        raise ValueError(f"reward.overlong_buffer.len must be positive, got {buffer_len}")
    if max_response_length < buffer_len:
        raise ValueError(f"reward.overlong_buffer.len ({buffer_len}) exceeds the response "
                         f"length limit rollout.max_new_tokens ({max_response_length})")
    expected = max_response_length - buffer_len
    exceed = response_lengths.to(torch.float32) - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


def _penalty(response_mask: torch.Tensor, cfg) -> torch.Tensor:
    ob = cfg.reward.overlong_buffer
    lengths = (response_mask > 0).sum(-1)
    return overlong_penalty(lengths, cfg.rollout.max_new_tokens, ob.len, ob.penalty_factor)


def shape_overlong(scores: torch.Tensor, response_mask: torch.Tensor, cfg) -> torch.Tensor:
    """``scores`` plus the penalty of ``cfg.reward.overlong_buffer`` (``scores`` when off)."""
    if not cfg.reward.overlong_buffer.enable:
        return scores
    return scores + _penalty(response_mask, cfg).to(device=scores.device, dtype=scores.dtype)


def overlong_metrics(response_mask: torch.Tensor, cfg) -> dict[str, float]:
    """``reward/overlong_penalty`` and ``reward/overlong_share`` of a batch, global over the
    data-parallel ranks ({} when the shaping is off)."""
    if not cfg.reward.overlong_buffer.enable:
        return {}
    penalty = _penalty(response_mask, cfg)
    return {"reward/overlong_penalty": dp_stats.row_mean(penalty),
            "reward/overlong_share": dp_stats.row_mean((penalty < 0).float())}


__all__ = ["overlong_penalty", "shape_overlong", "overlong_metrics"]
