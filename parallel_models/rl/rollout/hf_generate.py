"""The fsdp backend's fallback rollout: for a model family our registry lacks (no parallel
CausalLM to fill), the sharded HF actor generates itself with transformers' ``generate``
(``rl/backends/fsdp/hf_rollout.py``: ``synced_gpus``, every rank runs forwards until all are done).
It generates with the actor's current weights, so there is nothing to sync and nothing of its own
to offload (the actor role's offload covers its weights). Its ``rollout_log_probs`` are zeros
(transformers' generate does not return the sampler's log-probs here). The trainer's prompt seeds
make it draw our engine's tokens (greedy decoding over seeded noisy logits).
"""

from __future__ import annotations

from typing import Sequence

from parallel_models.rl.data.batch import RolloutBatch
from parallel_models.rl.rollout.interface import EngineTokens, batch_from_generation


class HFGenerateRollout(EngineTokens):
    """``HFGenerateRollout(engine)`` over an ``HFRolloutEngine`` (the sharded actor's model)."""

    pushes_weights = False

    def __init__(self, engine):
        self.engine = engine
        self.version: object = None

    def update_weights(self, version) -> None:
        """Nothing to copy: the engine generates with the actor's own (sharded) weights."""
        self.version = version

    def release_memory(self) -> None:
        """Nothing of its own to move (the weights are the actor role's)."""

    def resume_memory(self) -> None:
        """Nothing of its own to move (see :meth:`release_memory`)."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling, *,
                 max_new_tokens: Sequence[int] | None = None,
                 prompt_seeds: Sequence[int] | None = None) -> RolloutBatch:
        if max_new_tokens is not None:
            raise ValueError("per-prompt max_new_tokens caps need our rollout engine "
                             "(data.max_new_tokens_key: parallel.backend=megatron)")
        out = self.engine.generate(prompt_ids, sampling, prompt_seeds=prompt_seeds)
        return batch_from_generation(out, len(prompt_ids), sampling.n)


__all__ = ["HFGenerateRollout"]
