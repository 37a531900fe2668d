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

from parallel_models.rl.registry import Registry
from parallel_models.utils.tool_calls import HERMES_CLOSE, HERMES_OPEN, ParsedCall, parse_hermes

TOOL_CALL_FORMATS = Registry("tool call format", params=("text",), defaults={"call_end": None},
                             key="rollout.multi_turn.tool_call_format",
                             home="parallel_models.rl.agents.tool_call_format.TOOL_CALL_FORMATS")


TOOL_CALL_FORMATS.register("hermes", "qwen", call_end=HERMES_CLOSE)(parse_hermes)


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
