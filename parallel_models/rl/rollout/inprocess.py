"""The in-process rollout adapter: a :class:`~parallel_models.inference.RolloutEngine` (or an
engine with the same ``generate``, e.g. the fsdp backend's HF generation) in the trainer's
processes, in the training layout.

Two uses: the megatron backend's engine on the actor's own weights (PP = 1, TP' = TP: nothing
to sync, ``update_weights`` only notes the version), and the fsdp backend's engine on a copy of
the actor in our parallel CausalLM, which ``refill`` fills from the FSDP actor (a collective, layer
by layer) at the first ``generate`` after the actor changed.
"""

from __future__ import annotations

from typing import Callable, Sequence

from parallel_models.rl.data.batch import RolloutBatch
from parallel_models.rl.rollout.interface import EngineTokens, batch_from_generation

_NEVER = object()  # the version of a copy never filled


class InProcessRollout(EngineTokens):
    """``InProcessRollout(engine, num_experts=None, refill=None)``. ``num_experts`` (an MoE
    actor): the rows carry the routes the engine records. ``refill``: a callable that fills the
    engine's model from the actor (its own copy); None when the engine runs on the actor's
    weights."""

    pushes_weights = False

    def __init__(self, engine, *, num_experts: int | None = None,
                 refill: Callable[[], object] | None = None):
        self.engine = engine
        self.num_experts = num_experts
        self.refill = refill
        self.version: object = None  # the actor's weights, as last told by update_weights
        self._filled: object = _NEVER

    def update_weights(self, version) -> None:
        """The actor now holds ``version``: a copy is refilled at the next ``generate``."""
        self.version = version
        self._weights_changed()

    def _weights_changed(self) -> None:
        notify = getattr(self.engine, "weights_changed", None)  # (an FP8 rollout re-quantizes)
        if notify is not None:
            notify()

    def release_memory(self) -> None:
        """Nothing to move: the engine frees its KV cache after every generate, its weights are
        the actor's (its role offloads them) or the fsdp backend's copy (kept on the device)."""

    def resume_memory(self) -> None:
        """Nothing to move (see :meth:`release_memory`)."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling, *,
                 max_new_tokens: Sequence[int] | None = None,
                 prompt_seeds: Sequence[int] | None = None) -> RolloutBatch:
        if self.refill is not None and self._filled != self.version:
            self.refill()
            self._filled = self.version
            self._weights_changed()
        extra = {"record_routes": True} if self.num_experts is not None else {}
        if max_new_tokens is not None:  # per-prompt caps (the config checks where they work)
            extra["max_new_tokens"] = max_new_tokens
        if prompt_seeds is not None:  # per-sample draws of their own (layout-independent)
            extra["prompt_seeds"] = prompt_seeds
        out = self.engine.generate(prompt_ids, sampling, **extra)
        return batch_from_generation(out, len(prompt_ids), sampling.n)


__all__ = ["InProcessRollout"]
