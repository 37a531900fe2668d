"""The tools a multi-turn rollout offers, by name (``rollout.multi_turn.tools``).

An entry of ``rollout.multi_turn.tools`` is a built-in name of :data:`TOOLS` (``calculator``,
``python``) or ``path/to/file.py:object`` (also ``package.module:object``) naming either

* a :class:`~parallel_models.rl.agents.schema.Tool` (schema and ``run``), or
* a function with an ``openai_schema`` attribute: its OpenAI function schema, either
  ``{"type": "function", "function": {"name", "description", "parameters"}}`` or the inner
  ``{"name", "description", "parameters"}``; the function is called with the arguments as
  keywords and returns the result text.

:func:`resolve_tools` turns the list into ``{name: Tool}`` and raises
:class:`~parallel_models.errors.ConfigError` naming the entry for anything wrong (unknown name,
an object that is neither, a malformed schema, two tools of one name).
"""

from __future__ import annotations

from typing import Any, Sequence

from parallel_models.errors import ConfigError
from parallel_models.rl.agents.schema import Tool
from parallel_models.rl.registry import Registry

TOOLS = Registry("tool", key="rollout.multi_turn.tools",
                 home="parallel_models.rl.agents.tools.TOOLS")
TOOLS.add("calculator", "parallel_models.rl.agents.calculator:CALCULATOR")
TOOLS.add("python", "parallel_models.rl.agents.python_sandbox:PYTHON")


def as_tool(obj: Any, spec: str) -> Tool:
    """``obj`` (what ``spec`` names) as a :class:`Tool`; ConfigError when it is not one."""
    if isinstance(obj, Tool):
        tool = obj
    else:
        schema = getattr(obj, "openai_schema", None)
        if not callable(obj) or not isinstance(schema, dict):
            raise ConfigError(f"rollout.multi_turn.tools: {spec!r} is neither a Tool nor a "
                              "function with an 'openai_schema' dict attribute")
        function = schema.get("function", schema) if schema.get("type") == "function" \
            else schema
        tool = Tool(name=function.get("name", getattr(obj, "__name__", "")),
                    description=function.get("description", ""),
                    parameters=function.get("parameters", {"type": "object",
                                                           "properties": {}}),
                    run=obj)
    try:
        tool.check()
    except ValueError as err:
        raise ConfigError(f"rollout.multi_turn.tools: {spec!r}: {err}") from err
    return tool


def resolve_tools(specs: Sequence[str]) -> dict[str, Tool]:
    """``{name: Tool}`` of the ``rollout.multi_turn.tools`` entries ``specs``."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = as_tool(TOOLS.get(spec), spec)
        if tool.name in tools:
            raise ConfigError(f"rollout.multi_turn.tools: two tools are named {tool.name!r} "
                              f"(the second is {spec!r})")
        tools[tool.name] = tool
    return tools


__all__ = ["TOOLS", "as_tool", "resolve_tools"]
