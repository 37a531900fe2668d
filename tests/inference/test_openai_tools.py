"""Tool calling through the OpenAI-compatible chat API (inference/server/openai_tools.py), driven
by the official ``openai`` client: the server's OpenAI routes over a generate whose output is
forced (scripted token ids), served in process (ASGI). The client gets ``message.tool_calls``
(id, type, name, arguments as a JSON string) and ``finish_reason: "tool_calls"``, sends the tool
result back, and the prompts the engine gets are what transformers' ``apply_chat_template(...,
tools=...)`` renders for the same conversation (the oracle); ``tool_choice`` none / required /
named; bad tool requests are 400s naming the field."""

import asyncio
import json

import pytest

openai = pytest.importorskip("openai")

# a tool-aware chat template for the built-in character tokenizer, in the shape of Qwen2.5's
TEMPLATE = (
    "{{ bos_token }}{% if tools %}system: tools:{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}tool: <tool_response>{{ m.content }}"
    "</tool_response>\n{% else %}{{ m.role }}: {% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


class Forced:
    """The engine's generate with forced outputs: each call answers the next scripted text
    (its token ids + EOS) and records the rows (prompt ids) it was given."""

    def __init__(self, tok):
        self.tok, self.outputs, self.rows = tok, [], []

    async def __call__(self, rows, params, top_logprobs, sink=None):
        self.rows.append([list(r) for r in rows])
        text = self.outputs.pop(0)
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return [{"token_ids": ids, "log_probs": [-0.5] * len(ids), "finish_reason": "stop"}
                for _ in rows], 0


@pytest.fixture(scope="module")
def server():
    import httpx
    from fastapi import FastAPI

    from types import SimpleNamespace

    from parallel_models.inference.server.http_guards import error_response
    from parallel_models.inference.server.openai_api import OpenAIServing, openai_router
    from parallel_models.inference.server.openai_protocol import OpenAIError
    from parallel_models.tokenizer import build_builtin_tokenizer

    LIMITS = SimpleNamespace(max_n=4, max_prompts=4, max_batch=16, max_prompt_tokens=1024,
                             max_new_tokens=512)  # the server's ServerLimits fields it reads
    tok = build_builtin_tokenizer()
    tok.chat_template = TEMPLATE
    forced = Forced(tok)
    app = FastAPI()
    app.include_router(openai_router(OpenAIServing(
        tokenizer=tok, limits=LIMITS, vocab_size=74, max_positions=2048,
        model_name="tiny", generate=forced)))

    @app.exception_handler(OpenAIError)
    async def _openai_error(request, exc):
        return error_response(request.url.path, exc.status, exc.message, exc.param, exc.code)

    def client():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        return openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http,
                                  max_retries=0)

    return {"tok": tok, "forced": forced, "client": client}


def chat(server, outputs, **kwargs):
    server["forced"].outputs = list(outputs)

    async def go():
        async with server["client"]() as c:
            return await c.chat.completions.create(model="tiny", max_tokens=200, **kwargs)

    return asyncio.run(go())


def rendered(server, messages, prefix=""):
    """The oracle: transformers' chat template with the tools, tokenized (+ a forced prefix)."""
    tok = server["tok"]
    text = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                   tokenize=False)
    return tok(text + prefix, add_special_tokens=False)["input_ids"]


def call_text(name, arguments):
    return ('<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(arguments) +
            "}\n</tool_call>")


def test_tool_calls_and_the_tool_result_sent_back(server):
    user = {"role": "user", "content": "what is 2+3?"}
    first = chat(server, ["let me see " + call_text("calculator", {"expression": "2+3"})],
                 messages=[user], tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "let me see"
    (tc,) = choice.message.tool_calls
    assert tc.type == "function" and tc.id.startswith("call_")
    assert tc.function.name == "calculator"
    assert json.loads(tc.function.arguments) == {"expression": "2+3"}
    assert server["forced"].rows[-1] == [rendered(server, [user])]

    # the client sends the call and its result back; the template renders both
    assistant = {"role": "assistant", "content": choice.message.content,
                 "tool_calls": [tc.model_dump()]}
    tool = {"role": "tool", "tool_call_id": tc.id, "content": "5"}
    second = chat(server, ["it is 5"], messages=[user, assistant, tool], tools=TOOLS)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "it is 5"
    assert second.choices[0].message.tool_calls is None
    hf_assistant = {"role": "assistant", "content": "let me see", "tool_calls": [
        {"id": tc.id, "type": "function",
         "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}]}
    want = rendered(server, [user, hf_assistant, {**tool, "name": "calculator"}])
    assert server["forced"].rows[-1] == [want]
    text = server["tok"].decode(want)
    assert "<tool_response>5</tool_response>" in text and '"expression": "2+3"' in text


def test_tool_choice_none_required_and_named(server):
    user = {"role": "user", "content": "compute 7"}
    out = call_text("calculator", {"expression": "7"})
    none = chat(server, [out], messages=[user], tools=TOOLS, tool_choice="none")
    assert none.choices[0].finish_reason == "stop"
    assert none.choices[0].message.content == out and not none.choices[0].message.tool_calls

    # required: the answer starts with <tool_call> for the model; it writes the rest
    required = chat(server, [out[len("<tool_call>\n"):]], messages=[user], tools=TOOLS,
                    tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    assert required.choices[0].message.content is None
    assert server["forced"].rows[-1] == [rendered(server, [user], "<tool_call>\n")]

    named = {"type": "function", "function": {"name": "calculator"}}
    prefix = '<tool_call>\n{"name": "calculator", "arguments": '
    got = chat(server, ['{"expression": "1+1"}}\n</tool_call>'], messages=[user], tools=TOOLS,
               tool_choice=named)
    (tc,) = got.choices[0].message.tool_calls
    assert (tc.function.name, json.loads(tc.function.arguments)) == ("calculator",
                                                                      {"expression": "1+1"})
    assert server["forced"].rows[-1] == [rendered(server, [user], prefix)]
    assert got.usage.completion_tokens == len(server["tok"](
        '{"expression": "1+1"}}\n</tool_call>', add_special_tokens=False)["input_ids"]) + 1

    # two calls in one answer; parallel_tool_calls=false keeps the first
    two = call_text("calculator", {"expression": "1"}) + call_text("calculator",
                                                                   {"expression": "2"})
    both = chat(server, [two], messages=[user], tools=TOOLS)
    assert [json.loads(tc.function.arguments)["expression"] for tc in
            both.choices[0].message.tool_calls] == ["1", "2"]
    first = chat(server, [two], messages=[user], tools=TOOLS, parallel_tool_calls=False)
    assert [json.loads(tc.function.arguments)["expression"] for tc in
            first.choices[0].message.tool_calls] == ["1"]

    # a malformed call is no tool call: the text comes back as content
    bad = chat(server, ["<tool_call>{oops</tool_call>"], messages=[user], tools=TOOLS)
    assert bad.choices[0].finish_reason == "stop"
    assert bad.choices[0].message.content == "<tool_call>{oops</tool_call>"


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": TOOLS, "stream": True}, "stream"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "5"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages"),
])
def test_bad_tool_requests(server, kwargs, param):
    kwargs = {"messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        chat(server, ["x"], **kwargs)
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
