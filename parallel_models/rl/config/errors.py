"""Readable messages for PPO config problems: pydantic's errors turned into lines that name the
key (``actor.lr``), where the value came from (the YAML file or the override), the expected
type or range, and for an unknown key the valid keys of its section with a did-you-mean.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from parallel_models.errors import ConfigError

_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true/false", str: "a string"}
_PLURAL_NAMES = {int: "integers", float: "numbers", bool: "true/false values", str: "strings"}


def unknown_key(full: str, name: str, valid: list[str], where: str, source: str) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"{source}: unknown key {full!r}{hint}; valid keys of {where}: "
            f"{', '.join(sorted(valid))}")


def type_name(tp: Any) -> str:
    """``Optional[int]`` -> "an integer or null", ``Literal['a', 'b']`` -> "one of 'a', 'b'"."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return type_name(typing.get_args(tp)[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a)
                           for a in typing.get_args(tp))
    if origin is list:
        inner = typing.get_args(tp)[0]
        while typing.get_origin(inner) is typing.Annotated:
            inner = typing.get_args(inner)[0]
        return f"a list of {_PLURAL_NAMES.get(inner) or type_name(inner)}"
    if origin is tuple:
        return "a list of " + ", ".join(type_name(a) for a in typing.get_args(tp))
    return _TYPE_NAMES.get(tp, getattr(tp, "__name__", str(tp)))


def bounds_text(metadata: list) -> str | None:
    """``[Gt(0), Le(1)]`` -> "in (0, 1]"; ``[Ge(1)]`` -> ">= 1"."""
    lo = hi = None
    for m in metadata:  # annotated_types Gt / Ge / Lt / Le, as pydantic stores Field bounds
        if getattr(m, "gt", None) is not None:
            lo = f"({m.gt:g}"
        elif getattr(m, "ge", None) is not None:
            lo = f"[{m.ge:g}"
        elif getattr(m, "lt", None) is not None:
            hi = f"{m.lt:g})"
        elif getattr(m, "le", None) is not None:
            hi = f"{m.le:g}]"
    if lo and hi:
        return f"in {lo}, {hi}"
    if lo:
        return (">= " if lo[0] == "[" else "> ") + lo[1:]
    if hi:
        return ("<= " if hi[-1] == "]" else "< ") + hi[:-1]
    return None


def _is_model(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _field(model: type[BaseModel], section: str, key: str):
    """The field ``key`` of ``section`` (``key.sub``: a field of a nested group) and its model."""
    current = model.model_fields[section].annotation if section in model.model_fields \
        else None
    field = owner = None
    for part in key.split("."):
        if not _is_model(current):
            return None, None
        owner, field = current, current.model_fields.get(part)
        current = field.annotation if field is not None else None
    return field, owner


def _section_message(e: dict, model: type[BaseModel], section: str, source: str) -> str:
    if e["type"] == "extra_forbidden":
        return unknown_key(section, section, list(model.model_fields), "the config (sections)",
                           source)
    if e["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return (f"{source}: section {section!r} must be a mapping of key: value, got "
                f"{e.get('input')!r}")
    return f"{source}: {section}: {e.get('msg')}"


def _key_message(e: dict, model: type[BaseModel], section: str, key: str, where: str,
                 source: str) -> str:
    kind, value = e["type"], e.get("input")
    field, section_model = _field(model, section, key)
    full = f"{section}.{key}"
    if kind == "extra_forbidden":
        valid = list(section_model.model_fields) if section_model else []
        owner = section if "." not in key else f"{section}.{key.rsplit('.', 1)[0]}"
        return unknown_key(full, key.rsplit(".", 1)[-1], valid, f"section {owner!r}", source)
    whole_field = field is not None and where == full  # not an item of a list
    if kind in _BOUND_ERRORS and whole_field:
        rng = bounds_text(field.metadata) or e.get("msg")
        note = f" ({field.description})" if field.description else ""
        return f"{source}: {full} must be {rng}{note}, got {value!r}"
    if kind == "value_error":
        text = str(e.get("msg", "")).removeprefix("Value error, ")
        return f"{source}: {where}: {text}, got {value!r}"
    is_type_error = kind == "literal_error" or kind.endswith(("_type", "_parsing")) or \
        kind in ("int_from_float", "none_required")
    if is_type_error and whole_field:
        return (f"{source}: {where}: expected {type_name(field.annotation)}, got {value!r} "
                f"({type(value).__name__})")
    return f"{source}: {where}: {e.get('msg')}, got {value!r}"


def messages(err: ValidationError, model: type[BaseModel], sources: dict[str, str],
             default_source: str = "config") -> list[str]:
    """One line per problem of ``err`` (from validating ``model``, a model of sections), the
    first one per value; ``sources`` maps ``section.key`` to where its value came from."""
    out: list[str] = []
    seen: set[str] = set()
    for e in err.errors():
        loc = tuple(e.get("loc", ()))
        if not loc:  # the model-level (cross-field) validator: its message lists the problems
            text = str(e.get("msg", "")).removeprefix("Value error, ")
            out += [line for line in text.split("\n") if line]
            continue
        section = str(loc[0])
        key = str(loc[1]) if len(loc) > 1 else None
        rest = 2
        while key and rest < len(loc) and isinstance(loc[rest], str) and \
                _is_model(getattr(_field(model, section, key)[0], "annotation", None)):
            key, rest = f"{key}.{loc[rest]}", rest + 1  # a field of a nested group
        full = f"{section}.{key}" if key else section
        # the value's path: section.key then list positions (union member names are dropped)
        where = full + "".join(f"[{p}]" for p in loc[rest:] if isinstance(p, int))
        if where in seen:
            continue
        seen.add(where)
        top = f"{section}.{key.split('.')[0]}" if key else section
        source = sources.get(full, sources.get(top, sources.get(section, default_source)))
        out.append(_section_message(e, model, section, source) if key is None
                   else _key_message(e, model, section, key, where, source))
    return out


def raise_problems(problems: list[str], head: str = "invalid PPO config") -> None:
    """One :class:`ConfigError` listing every problem (nothing when there are none)."""
    if not problems:
        return
    if len(problems) == 1:
        raise ConfigError(f"{head}: {problems[0]}")
    raise ConfigError(f"{head}:\n  - " + "\n  - ".join(problems))
