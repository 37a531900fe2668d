"""The hybrid engine as a rollout backend: :class:`~parallel_models.rl.rollout.hybrid.HybridRollout`
(the actor trains in TP x PP x DP and rolls out in TP', same processes) behind the rollout
interface. The hybrid engine keeps its internals: it pools the prompts of all training DP ranks,
generates in the rollout layout and returns each rank its own rows; it re-shards the actor into
its rollout copy when the version it is asked for differs from the one it holds.
"""

from __future__ import annotations

from typing import Sequence

from parallel_models.rl.data.batch import RolloutBatch
from parallel_models.rl.rollout.interface import batch_from_dict


class HybridEngineRollout:
    """``HybridEngineRollout(hybrid, num_experts=None)`` over a built ``HybridRollout``;
    ``num_experts`` (an MoE actor): the rows carry their routes."""

    pushes_weights = False

    def __init__(self, hybrid, *, num_experts: int | None = None):
        self.hybrid = hybrid
        self.num_experts = num_experts
        self.version: object = None

    @property
    def engine(self):
        """The rollout engine (in the rollout layout)."""
        return self.hybrid.engine

    @property
    def eos_token_id(self):
        return self.hybrid.eos_token_id

    @property
    def pad_token_id(self):
        return self.hybrid.pad_token_id

    def update_weights(self, version) -> None:
        """The actor now holds ``version``: the next ``generate`` re-shards it into the rollout
        copy (the actor is on the device then); nothing when the engine shares the actor's
        weights (same layout)."""
        self.version = version

    def release_memory(self) -> None:
        """The rollout copy off the device when the hybrid engine releases it (a copy of its
        own, on CUDA); each generate brings it back and syncs it first."""
        self.hybrid.release_memory()

    def resume_memory(self) -> None:
        """The rollout copy's memory back on the device (when it was released)."""
        self.hybrid.resume_memory()

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling, *,
                 max_new_tokens: Sequence[int] | None = None,
                 prompt_seeds: Sequence[int] | None = None) -> RolloutBatch:
        out = self.hybrid.rollout(prompt_ids, sampling, version=self.version,
                                  num_experts=self.num_experts, max_new_tokens=max_new_tokens,
                                  prompt_seeds=prompt_seeds)
        return batch_from_dict(out)


__all__ = ["HybridEngineRollout"]
