"""The PPO config: its sections together, loaded from YAML and ``section.key=value`` overrides.

    cfg = load_config("ppo.yaml", ["actor.lr=1e-5", "trainer.total_steps=20"])
    cfg = load_config(None, [])            # the built-in default run (tiny Llama, CPU)

Defaults <- YAML file <- overrides are merged as plain data, then validated by pydantic in one
pass, so every problem is reported at once in one :class:`ConfigError`: unknown keys (with the
valid keys of the section and a did-you-mean), wrong types (the expected type), values out of
range, and the cross-field checks of :mod:`parallel_models.rl.config.checks` (skipped with
``validate=False``; ``cfg.validate(world_size)`` runs everything again, also after values were
assigned in code). Each message names where the value came from (the file or the override).
"""

from __future__ import annotations

import copy
import importlib.resources
import os
from typing import Any

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      model_validator)

from parallel_models.errors import ConfigError
from parallel_models.rl.config import errors
from parallel_models.rl.config.async_fields import async_correction
from parallel_models.rl.config.checks import cross_field_problems
from parallel_models.rl.config.fp8_rollout import fp8_rollout_defaults
from parallel_models.rl.config.sections import (SECTION_DEFAULTS, SECTIONS, ActorSection,
                                                AlgorithmSection, CriticSection, DataSection,
                                                ModelSection, ParallelSection, RewardSection,
                                                RolloutSection, TrainerSection)
from parallel_models.options import KernelOptions


def _section(name: str):
    klass = SECTIONS[name]
    return Field(default_factory=lambda: klass(**SECTION_DEFAULTS.get(name, {})),
                 description=(klass.__doc__ or "").strip().split("\n")[0])


class PPOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelSection = _section("model")
    parallel: ParallelSection = _section("parallel")
    data: DataSection = _section("data")
    rollout: RolloutSection = _section("rollout")
    actor: ActorSection = _section("actor")
    critic: CriticSection = _section("critic")
    reward: RewardSection = _section("reward")
    algorithm: AlgorithmSection = _section("algorithm")
    trainer: TrainerSection = _section("trainer")
    kernels: KernelOptions = _section("kernels")

    @model_validator(mode="before")
    @classmethod
    def _run_defaults(cls, data: Any) -> Any:
        """Sections given as mappings start from the PPO run's defaults (SECTION_DEFAULTS)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name, defaults in SECTION_DEFAULTS.items():
            if isinstance(data.get(name), dict):
                data[name] = {**defaults, **data[name]}
        return data

    @model_validator(mode="after")
    def _rollout_dtype_defaults(self) -> "PPOConfig":
        fp8_rollout_defaults(self)  # rollout.dtype=fp8: rollout correction on unless set
        return self

    @model_validator(mode="after")
    def _cross_field_checks(self, info: ValidationInfo) -> "PPOConfig":
        context = info.context or {}
        async_correction(self)  # async mode: the decoupled PPO correction on by default
        if context.get("cross_checks", True):
            problems = cross_field_problems(self, context.get("world_size"))
            if problems:
                raise ValueError("\n".join(problems))
        return self

    # ---- building ------------------------------------------------------------------------------
    @classmethod
    def build(cls, data: dict, sources: dict[str, str] | None = None, *,
              cross_checks: bool = True, world_size: int | None = None,
              source: str = "config") -> "PPOConfig":
        """Validate ``{section: {key: value}}`` (missing keys: defaults); one ConfigError with
        every problem, each naming its source (``sources``: dotted key -> file / override)."""
        try:
            return cls.model_validate(data, context={"cross_checks": cross_checks,
                                                     "world_size": world_size})
        except ValidationError as err:
            errors.raise_problems(errors.messages(err, cls, sources or {}, source))
            raise  # only when no message could be made of it

    @classmethod
    def from_dict(cls, data: dict | None, source: str = "config") -> "PPOConfig":
        merged: dict = {}
        sources: dict[str, str] = {}
        _merge_mapping(merged, sources, data or {}, source)
        return cls.build(merged, sources, cross_checks=False, source=source)

    # ---- conversion ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, dict[str, Any]]:
        return self.model_dump(mode="json", warnings=False)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def save(self, path: str | os.PathLike) -> str:
        """Write the config as YAML (atomically: temp file + rename); returns the path."""
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(self.to_yaml())
        os.replace(tmp, path)
        return path

    # ---- changing ------------------------------------------------------------------------------
    def _replace_with(self, data: dict, sources: dict[str, str], source: str) -> "PPOConfig":
        new = type(self).build(data, sources, cross_checks=False, source=source)
        for name in SECTIONS:
            setattr(self, name, getattr(new, name))
        return self

    def update(self, data: dict, source: str = "config") -> "PPOConfig":
        """Merge a nested ``{section: {key: value}}`` mapping (type-checked, unknown keys raise)."""
        merged = self.model_dump(warnings=False)
        sources: dict[str, str] = {}
        _merge_mapping(merged, sources, data, source)
        return self._replace_with(merged, sources, source)

    def set(self, dotted: str, value: Any, source: str = "override") -> None:
        """Set ``section.key`` to ``value`` after checking the key and the value's type."""
        merged = self.model_dump(warnings=False)
        sources: dict[str, str] = {}
        _set_dotted(merged, sources, dotted, value, source)
        self._replace_with(merged, sources, source)

    def get(self, dotted: str) -> Any:
        value = self
        for part in dotted.split("."):
            value = getattr(value, part)
        return value

    # ---- checks ----------------------------------------------------------------------------------
    def check_types(self) -> None:
        """Re-check every field (catches values assigned in code), without the cross checks."""
        self._replace_with(self.model_dump(warnings=False), {}, "config")

    def validate(self, world_size: int | None = None) -> "PPOConfig":  # noqa: D102
        """Check every field and the values together; raise one ConfigError listing every
        problem. ``world_size`` (default: ``$WORLD_SIZE`` or 1) is checked against the layout
        and the batch sizes."""
        new = type(self).build(self.model_dump(warnings=False), {}, world_size=world_size)
        for name in SECTIONS:
            setattr(self, name, getattr(new, name))
        return self


# ---- loading -----------------------------------------------------------------------------------
def _check_section(name: str, source: str) -> None:
    if name not in SECTIONS:
        raise ConfigError(errors.unknown_key(name, name, list(SECTIONS), "the config (sections)",
                                             source))


def _merge_mapping(merged: dict, sources: dict[str, str], data: Any, source: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections "
                          f"({', '.join(SECTIONS)}), got {type(data).__name__}")
    problems = []
    for section, values in data.items():
        try:
            _check_section(str(section), source)
        except ConfigError as err:
            problems.append(str(err))
            continue
        if values is None:
            continue
        if not isinstance(values, dict):
            problems.append(f"{source}: section {section!r} must be a mapping of key: value, "
                            f"got {values!r}")
            continue
        target = merged.setdefault(section, {})
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(target.get(key), dict):
                target[key].update(copy.deepcopy(value))  # a nested section: merge its fields
            else:
                target[key] = copy.deepcopy(value)
            sources[f"{section}.{key}"] = source
    errors.raise_problems(problems)


def _set_dotted(merged: dict, sources: dict[str, str], dotted: str, value: Any,
                source: str) -> None:
    parts = str(dotted).split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"{source}: {dotted!r} is not a 'section.key' name; sections: "
                          f"{', '.join(SECTIONS)}")
    section, key, *sub = parts
    _check_section(section, source)
    target = merged.setdefault(section, {})
    for name in [key, *sub][:-1]:  # section.key.sub: a field of a nested group
        if not isinstance(target.get(name), dict):
            target[name] = {}
        target = target[name]
    target[parts[-1]] = value
    sources[".".join(parts[:2])] = source


def default_config_path() -> str:
    """The packaged config file: the built-in defaults with a comment per field."""
    return str(importlib.resources.files("parallel_models.rl") / "configs" / "default.yaml")


def parse_override(text: str) -> tuple[str, Any]:
    """``"actor.lr=1e-5"`` -> ``("actor.lr", 1e-05)``; the value goes through yaml.safe_load."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.key=value "
                          "(e.g. trainer.total_steps=20)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if key.startswith("--"):
        key = key[2:]
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: the value is not valid YAML: {err}") from None
    return key, value


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                validate: bool = True, world_size: int | None = None) -> PPOConfig:
    """Defaults <- YAML file (if any) <- ``key=value`` overrides, validated in one pass (the
    cross-field checks too unless ``validate=False``)."""
    merged: dict = {}
    sources: dict[str, str] = {}
    if path is not None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file not found: {path}")
        with open(path) as f:
            try:
                data = yaml.safe_load(f)
            except yaml.YAMLError as err:
                raise ConfigError(f"{path}: not valid YAML: {err}") from None
        _merge_mapping(merged, sources, data or {}, path)
    problems = []
    for text in overrides or []:
        try:
            key, value = parse_override(text)
            _set_dotted(merged, sources, key, value, f"override {text!r}")
        except ConfigError as err:
            problems.append(str(err))
    errors.raise_problems(problems)
    return PPOConfig.build(merged, sources, cross_checks=validate, world_size=world_size)
