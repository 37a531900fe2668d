"""Tool calling in the OpenAI-compatible chat API (``POST /v1/chat/completions`` with
``tools``), in the Hermes/Qwen format the chat templates of Qwen2.5/Qwen3 (and Hermes models)
use: the model writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
(``utils/tool_calls.py`` reads them).

- The prompt: ``tools`` (OpenAI function specs) go to the chat template as transformers'
  ``apply_chat_template(messages, tools=...)`` takes them; assistant messages with
  ``tool_calls`` (their ``arguments`` strings parsed back to objects, as templates expect) and
  ``role: tool`` messages (``tool_call_id``; the function's ``name`` filled in from the call it
  answers, for templates that print it) are rendered by the template too (:func:`template_messages`).
- ``tool_choice``: ``"auto"`` (the default with tools): the answer's calls are returned as
  ``message.tool_calls``; ``"none"``: the text is returned as it is (no calls read);
  ``"required"``: the answer is started with ``<tool_call>`` for the model (a prefix after the
  generation prompt, :func:`forced_prefix`), a named function with
  ``<tool_call>\\n{"name": "NAME", "arguments": `` -- the model writes the rest. There is no
  constrained decoding: a model that writes no valid call still gets its text back as content.
- The answer (:func:`assistant_message`): every well-formed call becomes ``{"id": "call_...",
  "type": "function", "function": {"name", "arguments": JSON string}}``, the text outside the
  calls is the ``content`` (null when empty), and ``finish_reason`` is ``"tool_calls"``.
  Malformed blocks stay in the content. ``parallel_tool_calls: false`` keeps the first call
  only (the text after it is dropped).

Streaming with tools (other than ``tool_choice: "none"``) is refused (400 naming ``stream``).
"""

from __future__ import annotations

import json
import uuid

from parallel_models.inference.server.openai_protocol import (ChatCompletionRequest,
                                                               NamedToolChoice, OpenAIError)
from parallel_models.utils.tool_calls import HERMES_OPEN, hermes_spans, parse_hermes


def tool_mode(req: ChatCompletionRequest) -> str:
    """``"off"`` (no tools), ``"none"``, ``"auto"``, ``"required"`` or ``"named"``."""
    if not req.tools:
        return "off"
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        return "named"
    return choice or "auto"


def check_tool_request(req: ChatCompletionRequest) -> None:
    if req.stream and tool_mode(req) not in ("off", "none"):
        raise OpenAIError(400, "streaming with tools is not supported by this server; send "
                               "'stream': false (or 'tool_choice': 'none')", param="stream")


def template_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools as the chat template takes them (OpenAI function specs), or None."""
    if not req.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def template_messages(req: ChatCompletionRequest) -> list[dict]:
    """The messages as the chat template takes them; a tool message gets the ``name`` of the
    function whose call it answers (when an earlier assistant message made that call)."""
    messages = [m.as_template_input() for m in req.messages]
    names = {}
    for m in messages:
        for call in m.get("tool_calls", ()):
            names[call["id"]] = call["function"]["name"]
        if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
    return messages


def forced_prefix(req: ChatCompletionRequest) -> str:
    """The text the answer starts with for the model (``tool_choice`` required / named)."""
    mode = tool_mode(req)
    if mode == "required":
        return HERMES_OPEN + "\n"
    if mode == "named":
        name = json.dumps(req.tool_choice.function.name)
        return HERMES_OPEN + '\n{"name": ' + name + ', "arguments": '
    return ""


def assistant_message(text: str, mode: str, parallel: bool = True) -> tuple[dict, bool]:
    """The answer's ``message`` for the generated ``text`` (the forced prefix included) and
    whether it carries tool calls (``parallel=False``, ``parallel_tool_calls: false``: the
    first call only; the text of the others is dropped too)."""
    message = {"role": "assistant", "content": text, "refusal": None}
    if mode in ("off", "none"):
        return message, False
    calls, kept, at = [], [], 0
    for call, (start, end) in zip(parse_hermes(text), hermes_spans(text)):
        if call.error is not None:
            continue
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call.name,
                                   "arguments": json.dumps(call.arguments)}})
        kept.append(text[at:start])
        at = end
        if not parallel:
            at = len(text)
            break
    if not calls:
        return message, False
    kept.append(text[at:])
    content = "".join(kept).strip()
    message.update(content=content or None, tool_calls=calls)
    return message, True


__all__ = ["assistant_message", "check_tool_request", "forced_prefix", "template_messages",
           "template_tools", "tool_mode"]
