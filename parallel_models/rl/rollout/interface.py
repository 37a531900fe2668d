"""The rollout interface: how the PPO trainer generates, whatever generates.

Every rollout backend (``rollout.backend``, see ``registry.py``) hands the trainer an object
that satisfies :class:`Rollout`:

- ``generate(prompt_ids, sampling, *, max_new_tokens=None, prompt_seeds=None) ->
  RolloutBatch``: this rank's prompts (its data-parallel share; every rank calls together),
  ``sampling.n`` samples each, rows prompt-major. The batch holds ``sequences`` (left-padded
  prompt + right-padded response), ``attention_mask``, ``prompt_lengths``, ``response_mask``,
  ``group_index`` (the prompt of each row), the sampler's ``rollout_log_probs`` and, for an
  MoE actor whose rollout records them, ``routes``; on the device of the actor.
  ``max_new_tokens``: per prompt, a cap on its samples' new tokens (where the backend supports
  caps: the config checks say which).
  ``prompt_seeds``: per prompt, the seed of its samples' draws (the trainer's
  ``row_sampling.prompt_seed`` of run seed, step and the prompt's place in the global batch):
  sample j draws with ``row_seed(seed, j)``'s noise, so the tokens do not depend on the layout,
  the rank that generates them or the backend's batching (every built-in backend honours them).
- ``update_weights(version)``: the actor's weights changed (``version`` names them: the trainer
  passes its step index, after a resume and after every update). What that means is the
  backend's: the engine on the actor's own weights has nothing to do; a rollout copy (the hybrid
  engine, the fsdp backend's engine) is marked stale and refilled by the next ``generate`` (the
  actor is on the device then); the HTTP server gets the weights now (``pushes_weights``).
- ``pushes_weights``: True when ``update_weights`` moves the weights at once (the trainer then
  times it as its own ``sync`` phase and puts the actor on the device for it), False when it
  only marks a copy stale.
- ``release_memory()`` / ``resume_memory()``: move what the rollout keeps between generates (a
  rollout copy of the weights, a KV cache) off the accelerator and back. A ``generate`` after
  ``release_memory`` brings back what it needs by itself and releases it again afterwards.
  Backends with nothing of their own to move (the engine on the actor's weights frees its KV
  cache after every call; the server's memory is the server's) do nothing.

:func:`batch_from_generation` turns an engine's :class:`GenerationOutput` into that batch.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

from parallel_models.rl.data.batch import RolloutBatch


@runtime_checkable
class Rollout(Protocol):
    """What the trainer needs from a rollout backend (see the module docstring)."""

    pushes_weights: bool

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling, *,
                 max_new_tokens: Sequence[int] | None = None,
                 prompt_seeds: Sequence[int] | None = None) -> RolloutBatch:
        ...

    def update_weights(self, version) -> None:
        ...

    def release_memory(self) -> None:
        ...

    def resume_memory(self) -> None:
        ...


class EngineTokens:
    """The special tokens of an adapter over an engine (``self.engine``), read from it."""

    engine: object

    @property
    def eos_token_id(self):
        return self.engine.eos_token_id

    @property
    def pad_token_id(self):
        return self.engine.pad_token_id


def batch_from_generation(out, prompts: int, n: int) -> RolloutBatch:
    """The trainer's batch from a :class:`~parallel_models.inference.GenerationOutput` of
    ``prompts`` prompts with ``n`` samples each (rows prompt-major)."""
    return RolloutBatch(sequences=out.sequences, attention_mask=out.attention_mask,
                        prompt_lengths=out.prompt_mask.sum(-1), response_mask=out.response_mask,
                        group_index=torch.arange(prompts).repeat_interleave(n),
                        rollout_log_probs=out.log_probs, routes=out.routes)


def batch_from_dict(out: dict) -> RolloutBatch:
    """The trainer's batch from a rollout dict (``samples_batch.batch_from_response``'s shape):
    its ``weight_version`` is dropped, the sampler's log-probs (mismatch metrics, TIS) stay."""
    out = dict(out)
    out.pop("weight_version", None)
    return RolloutBatch.from_dict(out)


__all__ = ["EngineTokens", "Rollout", "batch_from_dict", "batch_from_generation"]
