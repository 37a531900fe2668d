"""Registries by name for what a user can add to the PPO trainer without editing it: training
backends (``parallel.backend``, here) and rollout backends (``rollout.backend``,
``rl/rollout/registry.py``).

A :class:`Registry` maps a config value to an entry: the object itself, or a lazy reference
(``"package.module"`` for a module, ``"package.module:name"`` for an attribute of one) resolved
on first use, so that listing and checking the names imports nothing heavy (the config checks
run before torch is imported). A user registers their own before the config is loaded::

    from parallel_models.rl.backends.registry import TRAINING_BACKENDS
    TRAINING_BACKENDS.register("mine", "my_package.my_backend")

A training backend (a module or any object) has three functions:

- ``check_model(cfg)``: fail early (before the process groups exist) with a ``ConfigError`` when
  the model cannot run in this backend / layout;
- ``build_roles(cfg, tokenizer, model_path) -> Roles``: the actor, reference, critic, reward and
  rollout (``rl/backends/roles.py``), built on every rank;
- ``export_hf(roles, output_dir, tokenizer)``: the trained actor (and critic) as HF folders
  (``actor_hf/``, ``critic_hf/``), at the end of a run with ``trainer.save_hf_at_end``.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Protocol, runtime_checkable

from parallel_models.errors import ConfigError


class Registry:
    """``Registry(what, key, home)``: ``what`` names the kind of entry in messages ("rollout
    backend"), ``key`` the config key whose values it holds ("rollout.backend"), ``home`` where
    the registry lives (the messages say how to add an entry)."""

    def __init__(self, what: str, key: str, home: str):
        self.what, self.key, self.home = what, key, home
        self._entries: dict[str, Any] = {}

    def register(self, name: str, entry: Any) -> Any:
        """Add ``entry`` (an object, or a ``"module"`` / ``"module:attr"`` reference) under
        ``name``; replaces an earlier entry of that name. Returns ``entry``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.what} needs a non-empty name, got {name!r}")
        self._entries[name] = entry
        return entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def problem(self, name: str) -> str | None:
        """Why ``name`` is not a valid value (None when it is registered)."""
        if name in self._entries:
            return None
        close = difflib.get_close_matches(str(name), self.names(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return (f"not a registered {self.what} ({hint}registered: {', '.join(self.names())}; "
                f"add one with {self.home}.register)")

    def get(self, name: str) -> Any:
        """The entry of ``name`` (a lazy reference is imported now); a ``ConfigError`` naming
        the key when ``name`` is not registered."""
        problem = self.problem(name)
        if problem is not None:
            raise ConfigError(f"{self.key}={name!r}: {problem}")
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = importlib.import_module(module)
            if attr:
                entry = getattr(entry, attr)
            self._entries[name] = entry
        return entry


@runtime_checkable
class TrainingBackend(Protocol):
    """What a ``parallel.backend`` entry provides (see the module docstring)."""

    def check_model(self, cfg) -> None:
        ...

    def build_roles(self, cfg, tokenizer, model_path: str):
        ...

    def export_hf(self, roles, output_dir: str, tokenizer) -> None:
        ...


TRAINING_BACKENDS = Registry("training backend", "parallel.backend",
                             "parallel_models.rl.backends.registry.TRAINING_BACKENDS")
TRAINING_BACKENDS.register("megatron", "parallel_models.rl.backends.megatron")
TRAINING_BACKENDS.register("fsdp", "parallel_models.rl.backends.fsdp.factory")


def training_backend(name: str) -> TrainingBackend:
    """The registered training backend ``name``, checked against :class:`TrainingBackend`."""
    backend = TRAINING_BACKENDS.get(name)
    if not isinstance(backend, TrainingBackend):
        missing = [f for f in ("check_model", "build_roles", "export_hf")
                   if not callable(getattr(backend, f, None))]
        raise ConfigError(f"parallel.backend={name!r}: {backend!r} is not a training backend "
                          f"(it lacks {', '.join(missing)})")
    return backend


__all__ = ["Registry", "TRAINING_BACKENDS", "TrainingBackend", "training_backend"]
