"""Tool calls in the Hermes/Qwen format, read out of model text: the one parser both the
multi-turn rollouts (``rl/agents/tool_call_format.py``, its ``hermes`` format) and the
OpenAI-compatible server (``inference/server/openai_tools.py``) use::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    </tool_call>

Every ``<tool_call>...</tool_call>`` block is one call (:func:`parse_hermes`). A block whose body
is not a JSON object with a string ``name`` and an object ``arguments`` (a JSON string holding an
object is accepted, as some models write it), or a ``<tool_call>`` never closed, is still
returned, as a :class:`ParsedCall` with ``error`` set. :func:`hermes_spans` gives where the
blocks are (the text around them is the message's content).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(" + re.escape(HERMES_CLOSE) + r"|$)",
                           re.DOTALL)


@dataclass
class ParsedCall:
    """One tool call of a turn: ``name`` and ``arguments`` as the model wrote them, ``raw`` the
    text of the call, ``error`` why it could not be read (then name/arguments may be empty)."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None


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


def hermes_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of every ``<tool_call>`` block of ``text`` (to its end when unclosed)."""
    return [match.span() for match in _HERMES_BLOCK.finditer(text)]


__all__ = ["HERMES_CLOSE", "HERMES_OPEN", "ParsedCall", "hermes_spans", "parse_hermes"]
