"""The inference engine's public interface: what RL and users import, by name, from
``parallel_models.inference``.

- generation: :class:`RolloutEngine` (prompts + :class:`SamplingParams` -> samples, atomic weight
  swaps), :class:`ContinuousEngine` (continuous batching), :func:`generate` and its
  :class:`GenerationOutput`, :class:`SamplingFields` (the sampling knobs as config fields),
  :func:`prompt_seed` (a prompt's draw seed of run seed, step and place in the global batch),
  :func:`seeded_noise_logits` (the same draws through another engine's argmax);
- the rollout layout: :func:`build_rollout_layout` (the engine's TP' layout, a second
  :class:`~parallel_models.parallel_layout.ParallelLayout` beside the training one),
  :func:`same_as_training` and :func:`share_of`;
- weight sync into an engine: :class:`WeightSync` (a training layout -> the rollout layout, in
  buckets of ``DEFAULT_BUCKET_BYTES``), :class:`TensorReader` (tensors in memory as a loader
  source);
- the rollout server: :class:`RolloutClient` / :class:`ServerError`, and the weight pushes to a
  server (:func:`push_actor_weights`: stream, process group or folder; :func:`push_weight_stream`,
  :func:`push_weight_group`, :func:`push_weights`, :class:`WeightStreamError`; a stream push off
  the caller's critical path: :class:`BackgroundPush`);
  :func:`start_server` / :func:`stop_server` launch one as a subprocess.

Names are imported on first use (a module ``__getattr__``), so ``import parallel_models.inference``
stays cheap (no torch kernels, no HTTP client) until a name is asked for.
"""

from __future__ import annotations

import importlib

#: public name -> the module (under ``parallel_models.inference``) that defines it
_EXPORTS = {
    "RolloutEngine": "engine", "WeightUpdateError": "engine",
    "ContinuousEngine": "continuous", "KVBudgetError": "continuous",
    "GenerationOutput": "generation", "generate": "generation",
    "SamplingParams": "sampling", "SamplingFields": "sampling",
    "prompt_seed": "row_sampling", "row_seed": "row_sampling",
    "seeded_noise_logits": "row_sampling",
    "build_rollout_layout": "rollout_layout", "same_as_training": "rollout_layout",
    "share_of": "rollout_layout",
    "WeightSync": "weight_sync", "TensorReader": "weight_sync",
    "DEFAULT_BUCKET_BYTES": "weight_sync",
    "RolloutClient": "server.client", "ServerError": "server.client",
    "push_actor_weights": "server.weight_push", "push_weights": "server.weight_push",
    "push_weight_stream": "server.weight_stream", "WeightStreamError": "server.weight_stream",
    "push_weight_group": "server.weight_group_push",
    "BackgroundPush": "server.background_push",
    "start_server": "server.launch", "stop_server": "server.launch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next look-up skips this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
