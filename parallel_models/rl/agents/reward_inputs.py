"""What the reward of a multi-turn sample sees besides the prompt and the response.

* :func:`attach_conversations`: each row's dataset record gets ``conversation`` (the messages:
  the prompt, the model's turns as decoded text, tool results, observations) and ``tool_trace``
  (per call: turn, name, arguments, result, error, seconds), so a reward function reads them as
  the ``conversation=`` / ``tool_trace=`` keywords (``rl/rewards/calls.py``: record fields become
  keywords) or from ``records=``. The response it gets is the model's tokens only (the
  ``response_mask``), tool and environment text excluded.
* :func:`add_environment_rewards`: the environment's summed step rewards added to the scores.

Both do nothing for a single-turn batch (no ``conversation`` column).
"""

from __future__ import annotations

import torch


def attach_conversations(batch) -> None:
    """Add the row's conversation and tool trace to each record of ``batch`` (see above)."""
    if "conversation" not in batch.columns:
        return
    records = batch.columns.get("records") or [{} for _ in batch.columns["conversation"]]
    batch["records"] = [dict(record or {}, conversation=conversation, tool_trace=trace)
                        for record, conversation, trace in zip(
                            records, batch.columns["conversation"], batch.columns["tool_trace"])]


def rollout_records(rollout, records, mine: list[int]) -> dict:
    """The keywords of a rollout that takes the prompts' dataset records (a multi-turn rollout:
    its environments reset from them): ``{"records": [...]}`` for the prompts at ``mine``, else
    no keywords."""
    if not getattr(rollout, "takes_records", False):
        return {}
    has = isinstance(records, dict) and "records" in records
    return {"records": [records["records"][i] if has else {} for i in mine]}


def add_environment_rewards(batch, scores: torch.Tensor) -> torch.Tensor:
    """``scores`` plus each row's environment reward (rows without one: unchanged)."""
    rewards = batch.columns.get("environment_reward")
    if not rewards or all(r is None for r in rewards):
        return scores
    extra = torch.tensor([float(r or 0.0) for r in rewards], dtype=scores.dtype)
    return scores + extra.to(scores.device)


__all__ = ["add_environment_rewards", "attach_conversations", "rollout_records"]
