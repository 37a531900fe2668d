"""The OpenAI-compatible API's wire format: request bodies (pydantic), the error body and the
fields this server refuses.

Requests of ``POST /v1/completions`` and ``POST /v1/chat/completions`` are validated strictly
(``extra="forbid"``, strict ints and bools), so a wrong type, an out-of-range value or an unknown
field is a 400 naming the field (``param``). Fields the OpenAI API has but this server cannot
honor (penalties, ``logit_bias``, ``echo``, ``suffix``, ...) are refused with a 400
naming the field too, unless the client sends their neutral value (e.g. ``frequency_penalty:
0``), rather than silently ignored.

Errors have the OpenAI body ``{"error": {"message", "type", "param", "code"}}`` with type
``invalid_request_error`` for 4xx (the OpenAI API uses it for 401 and 404 too, with the codes
``invalid_api_key`` / ``model_not_found``) and ``server_error`` for 5xx.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      model_validator)

from parallel_models.inference.sampling import Number, TokenId

MAX_TOP_LOGPROBS = 20
SEED_LIMIT = 1 << 62  # seeds are in [0, 2^62): the draws' seed mixing is modulo 2^62
MAX_STOP_STRINGS = 16
MAX_TOOLS = 128


class OpenAIError(Exception):
    """An error answered in the OpenAI body shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` for an answer with ``status``."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# field -> the values that mean "not used" (sent by some clients by default); anything else is
# refused with a 400 naming the field
_NEUTRAL: dict[str, tuple] = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
}


def _same(a, b) -> bool:
    """``a == b`` without ``True == 1`` / ``0 == False`` (but ``0 == 0.0``)."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def refuse_unsupported(data) -> dict:
    """``data`` without the unsupported fields that carry their neutral value; a 400 naming the
    first one that carries another value."""
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    out = {}
    for key, value in data.items():
        neutral = _NEUTRAL.get(key)
        if neutral is None:
            out[key] = value
        elif not any(_same(value, v) for v in neutral):
            raise OpenAIError(400, f"'{key}' is not supported by this server (got {value!r}); "
                                   "leave it out", param=key, code="unsupported_parameter")
    return out


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


StopStrings = Union[Annotated[StrictStr, Field(min_length=1)],
                    Annotated[list[Annotated[StrictStr, Field(min_length=1)]],
                              Field(max_length=MAX_STOP_STRINGS)]]


class _GenerationRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    n: StrictInt = Field(1, ge=1)
    temperature: Optional[Number] = Field(None, ge=0, le=2)
    top_p: Optional[Number] = Field(None, gt=0, le=1)
    stop: Optional[StopStrings] = None
    seed: Optional[StrictInt] = Field(None, ge=0, lt=SEED_LIMIT)
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = None  # an end-user id (accepted, not used)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "'stream_options' is only allowed with 'stream': true",
                              param="stream_options")


NonEmpty = Field(min_length=1)
Prompt = Union[StrictStr,
               Annotated[list[StrictStr], NonEmpty],
               Annotated[list[TokenId], NonEmpty],
               Annotated[list[Annotated[list[TokenId], NonEmpty]], NonEmpty]]


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids
    or a list of token-id lists; ``logprobs=k`` returns the k most likely tokens per step."""

    prompt: Prompt
    max_tokens: Optional[StrictInt] = Field(16, ge=1)
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts as a list of strings / token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr
    arguments: StrictStr  # a JSON object, as a string (the OpenAI wire format)


class ToolCall(BaseModel):
    """A call an assistant message made (``message.tool_calls[i]``)."""

    model_config = ConfigDict(extra="forbid")

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_template_input(self) -> dict:
        """The call as chat templates read it (``arguments`` a dict, as transformers' tool
        examples pass it; a string that is not a JSON object stays a string)."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(BaseModel):
    """One message: text content (a string or text parts); an assistant message may carry
    ``tool_calls`` (then its content may be null), a ``tool`` message answers the call
    ``tool_call_id``. No images."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[StrictStr, list[TextPart]]] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[StrictStr] = None

    @model_validator(mode="after")
    def _fields_of_the_role(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages carry them, not {self.role}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message needs the id of the call it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (null only for an assistant message with "
                             "tool_calls)")
        return self

    def as_template_input(self) -> dict:
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(part.text for part in self.content)
        out = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.as_template_input() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionSpec(BaseModel):
    """A function the model may call (OpenAI's ``tools[i].function``)."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: Optional[StrictStr] = None
    parameters: Optional[dict] = None
    strict: Optional[StrictBool] = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call that function."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template;
    ``logprobs: true`` (+ ``top_logprobs``) returns per-token log-probs."""

    messages: Annotated[list[ChatMessage], NonEmpty]
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[Annotated[list[ToolSpec], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = None  # false: the first call only

    def check(self) -> None:
        super().check()
        names = [t.function.name for t in self.tools or []]
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise OpenAIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise OpenAIError(400, f"tool_choice names the function {choice.function.name!r}, "
                                   f"which is not in tools ({', '.join(names)})",
                              param="tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise OpenAIError(400, "'max_tokens' and 'max_completion_tokens' differ; give one",
                              param="max_completion_tokens")

    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else \
            self.max_tokens


__all__ = ["SEED_LIMIT", "ChatCompletionRequest", "ChatMessage", "CompletionRequest",
           "NamedToolChoice", "OpenAIError", "StreamOptions", "ToolCall", "ToolSpec", "error_body",
           "refuse_unsupported"]
