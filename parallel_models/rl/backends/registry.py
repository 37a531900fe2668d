"""The training backends by name (``parallel.backend``; the registry class is
``parallel_models.rl.registry.Registry``, shared with the rollout backends, estimators, losses and
rewards). An entry is the backend object or a lazy reference (``"package.module"``) imported on
first use, so that checking the names imports nothing heavy (the config checks run before torch is
imported). A user adds their own before the config is loaded::

    from parallel_models.rl.backends.registry import TRAINING_BACKENDS
    TRAINING_BACKENDS.add("mine", "my_package.my_backend")

A training backend (a module or any object) has three functions:

- ``check_model(cfg)``: fail early (before the process groups exist) with a ``ConfigError`` when
  the model cannot run in this backend / layout;
- ``build_roles(cfg, tokenizer, model_path) -> Roles``: the actor, reference, critic, reward and
  rollout (``rl/backends/roles.py``), built on every rank;
- ``export_hf(roles, output_dir, tokenizer)``: the trained actor (and critic) as HF folders
  (``actor_hf/``, ``critic_hf/``), at the end of a run with ``trainer.save_hf_at_end``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from parallel_models.errors import ConfigError
from parallel_models.rl.registry import Registry


@runtime_checkable
class TrainingBackend(Protocol):
    """What a ``parallel.backend`` entry provides (see the module docstring)."""

    def check_model(self, cfg) -> None:
        ...

    def build_roles(self, cfg, tokenizer, model_path: str):
        ...

    def export_hf(self, roles, output_dir: str, tokenizer) -> None:
        ...


TRAINING_BACKENDS = Registry("training backend", key="parallel.backend", user_functions=False,
                             home="parallel_models.rl.backends.registry.TRAINING_BACKENDS")
TRAINING_BACKENDS.add("megatron", "parallel_models.rl.backends.megatron")
TRAINING_BACKENDS.add("fsdp", "parallel_models.rl.backends.fsdp.factory")


def training_backend(name: str) -> TrainingBackend:
    """The registered training backend ``name``, checked against :class:`TrainingBackend`."""
    backend = TRAINING_BACKENDS.get(name)
    if not isinstance(backend, TrainingBackend):
        missing = [f for f in ("check_model", "build_roles", "export_hf")
                   if not callable(getattr(backend, f, None))]
        raise ConfigError(f"parallel.backend={name!r}: {backend!r} is not a training backend "
                          f"(it lacks {', '.join(missing)})")
    return backend


__all__ = ["TRAINING_BACKENDS", "TrainingBackend", "training_backend"]
