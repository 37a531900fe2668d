"""Tools declared as OpenAI function schemas, and the check of a call's arguments against them.

A tool is a :class:`Tool`: its OpenAI function schema (``name``, ``description``,
``parameters``: a JSON Schema object) and ``run(**arguments) -> str``, the text the model reads
as the tool result. :meth:`Tool.openai_schema` gives the ``{"type": "function", "function":
{...}}`` entry chat templates take as ``tools=``.

:func:`argument_errors` checks arguments against ``parameters`` for the JSON Schema subset
function schemas use (``type`` -- object, string, integer, number, boolean, array, null, or a
list of them --, ``properties``, ``required``, ``additionalProperties: false``, ``enum``,
``items``); the keywords it does not know it ignores (the ``jsonschema`` package is not a
dependency here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


@dataclass
class Tool:
    """A tool the model may call: ``name``, ``description``, ``parameters`` (JSON Schema of
    the arguments object) and ``run(**arguments) -> str``."""

    name: str
    description: str
    parameters: dict
    run: Callable[..., str]

    def __call__(self, **arguments: Any) -> str:
        return self.run(**arguments)

    def openai_schema(self) -> dict:
        """The tool as an OpenAI ``tools=`` entry (what chat templates render)."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}

    def check(self) -> None:
        """Raise ValueError when the declaration itself is malformed."""
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a tool needs a non-empty string name, got {self.name!r}")
        if not isinstance(self.parameters, dict) or self.parameters.get("type", "object") \
                != "object":
            raise ValueError(f"tool {self.name!r}: 'parameters' must be a JSON Schema of type "
                             f"'object', got {self.parameters!r}")
        if not callable(self.run):
            raise ValueError(f"tool {self.name!r}: 'run' is not callable")


def argument_errors(schema: dict, value: Any, where: str = "arguments") -> list[str]:
    """What is wrong with ``value`` against the JSON Schema ``schema`` (empty: nothing)."""
    errors: list[str] = []
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_JSON_TYPES.get(t, lambda v: True)(value) for t in names):
            return [f"{where}: expected {' or '.join(names)}, got {_json_type(value)} "
                    f"{value!r}"[:300]]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{where}: missing required argument {key!r}")
        for key, item in value.items():
            if key in properties:
                errors += argument_errors(properties[key], item, f"{where}.{key}")
            elif schema.get("additionalProperties", True) is False:
                errors.append(f"{where}: unexpected argument {key!r} (expected: "
                              f"{', '.join(properties) or 'none'})")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += argument_errors(schema["items"], item, f"{where}[{i}]")
    return errors


def _json_type(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _JSON_TYPES[name](value):
            return name
    return type(value).__name__


__all__ = ["Tool", "argument_errors"]
