"""Tool calls in a model's turn: parsing them out of the generated text.

A format is a function ``parse(text) -> list[ParsedCall]`` registered in
:data:`TOOL_CALL_FORMATS` (``rollout.multi_turn.tool_call_format``; ``path.py:function`` for
your own). The built-in ``hermes`` format is the one Qwen2.5/Qwen3 chat templates render (and
NousResearch's Hermes models emit)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    </tool_call>

Every ``<tool_call>...</tool_call>`` block is one call. A block whose body is not a JSON object
with a string ``name`` and an object ``arguments`` (a JSON string holding an object is accepted,
as some models write it), or a ``<tool_call>`` never closed, is still returned, as a call with
``error`` set: the executor answers it with that error as the tool result, so the model learns
from its malformed call instead of the run failing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from parallel_models.rl.registry import Registry

TOOL_CALL_FORMATS = Registry("tool call format", params=("text",), defaults={"call_end": None},
                             key="rollout.multi_turn.tool_call_format",
                             home="parallel_models.rl.agents.tool_call_format.TOOL_CALL_FORMATS")


@dataclass
class ParsedCall:
    """One tool call of a turn: ``name`` and ``arguments`` as the model wrote them, ``raw`` the
    text of the call, ``error`` why it could not be read (then name/arguments may be empty)."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(" + re.escape(HERMES_CLOSE) + r"|$)",
                           re.DOTALL)


@TOOL_CALL_FORMATS.register("hermes", "qwen", call_end=HERMES_CLOSE)
def parse_hermes(text: str) -> list[ParsedCall]:
    """The calls of ``text`` in the Hermes/Qwen format (see the module docstring)."""
    calls = []
    for match in _HERMES_BLOCK.finditer(text):
        body, closed = match.group(1), bool(match.group(2))
        if not closed:
            calls.append(ParsedCall(raw=match.group(0), error=f"unterminated {HERMES_OPEN}: "
                                    f"no {HERMES_CLOSE} after it"))
            continue
        calls.append(_call_from_json(body.strip(), match.group(0)))
    return calls


def _call_from_json(body: str, raw: str) -> ParsedCall:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as err:
        return ParsedCall(raw=raw, error=f"the tool call is not valid JSON: {err}")
    if not isinstance(payload, dict):
        return ParsedCall(raw=raw, error="the tool call must be a JSON object with 'name' and "
                          f"'arguments', got {type(payload).__name__}")
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall(raw=raw, error="the tool call has no string 'name'")
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            return ParsedCall(name=name, raw=raw,
                              error=f"the 'arguments' of {name!r} are not valid JSON: {err}")
    if not isinstance(arguments, dict):
        return ParsedCall(name=name, raw=raw, error=f"the 'arguments' of {name!r} must be a "
                          f"JSON object, got {type(arguments).__name__}")
    return ParsedCall(name=name, arguments=arguments, raw=raw)


def call_end_text(format_name: str = "hermes") -> str | None:
    """The text that closes a call in the format ``format_name`` names (``call_end``; a user's
    parse function may set ``parse.call_end = "..."``), None when it has none: a model turn
    stops there (``rollout.multi_turn.stop_at_call_end``)."""
    return TOOL_CALL_FORMATS.attribute(TOOL_CALL_FORMATS.get(format_name), "call_end")


def parse_tool_calls(text: str, format_name: str = "hermes") -> list[ParsedCall]:
    """The calls of ``text`` in the format ``format_name`` names (registered or ``file.py:fn``)."""
    return list(TOOL_CALL_FORMATS.get(format_name)(text=text))


__all__ = ["TOOL_CALL_FORMATS", "ParsedCall", "call_end_text", "parse_hermes", "parse_tool_calls",
           "HERMES_OPEN", "HERMES_CLOSE"]
