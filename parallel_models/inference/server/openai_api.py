"""The OpenAI-compatible API of the rollout server (beside its own ``/generate``).

- ``GET /v1/models``, ``GET /v1/models/{id}``: the served model; its id is the ``--model``
  argument (the folder's name is accepted as ``model`` too).
- ``POST /v1/completions``: ``prompt`` (string, list of strings, token ids, list of token-id
  lists; strings encoded like ``/generate``'s, with the tokenizer's special tokens), ``n``,
  ``max_tokens`` (default 16), ``temperature`` (0 = greedy; default 1), ``top_p``, ``stop``,
  ``seed``, ``logprobs=k`` (``tokens``, ``token_logprobs``, ``top_logprobs``: the k most likely
  tokens plus the chosen one, ``text_offset``: offsets into the returned text), ``stream``.
- ``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's chat template
  (``apply_chat_template``, generation prompt added), ``max_completion_tokens`` / ``max_tokens``
  (default: up to the server's limit and the model's context), ``logprobs: true`` +
  ``top_logprobs``, and the fields above; ``tools`` / ``tool_choice`` (answers with
  ``message.tool_calls`` and ``finish_reason: "tool_calls"``), ``role: "tool"`` messages and
  assistant messages with ``tool_calls`` in the history (``openai_tools``).

Choices are prompt-major (``index = prompt * n + sample``). Text is decoded without special
tokens; it ends before the ``stop`` string that is completed first, as if generation had stopped
there (``finish_reason: "stop"``; the tokens up to the one that completed it count in
``usage``), and a stop string that is exactly one token also ends generation at that token.
``finish_reason`` is ``"stop"`` for EOS / a stop string (``"tool_calls"`` when the answer
calls tools), else ``"length"``. Log-probs are those of the distribution the sampler drew from
(``log_softmax(logits / temperature)``; raw logits when greedy), like ``/generate``'s.
``system_fingerprint`` is ``weights-v{weight_version}`` (null in streams).

``stream: true`` answers server-sent events as tokens are drawn (``openai_stream``).

Requests go through the server's batcher with the native requests. Errors use the OpenAI error
body (``openai_protocol``); the limits of ``/generate`` apply (over a limit: 400 naming the
field).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Awaitable, Callable

from fastapi import APIRouter, Request
from pydantic import ValidationError

from parallel_models.inference.sampling import SamplingParams
from parallel_models.inference.server.http_guards import BadBody, parse_json_body
from parallel_models.inference.server.openai_protocol import (ChatCompletionRequest,
                                                               CompletionRequest, OpenAIError,
                                                               refuse_unsupported)
from parallel_models.inference.server.openai_text import (finish_text, single_token_stops,
                                                           token_string)
from parallel_models.inference.server.openai_tools import (assistant_message, check_tool_request,
                                                            forced_prefix, template_messages,
                                                            template_tools, tool_mode)

# (rows, params, top_logprobs[, sink of streamed steps]) -> (samples, weight_version)
GenerateFn = Callable[..., Awaitable[tuple]]


async def _parse(request: Request, model_cls):
    try:
        data = parse_json_body(await request.body())
    except BadBody as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None
    data = refuse_unsupported(data)
    try:
        req = model_cls.model_validate(data)
    except ValidationError as exc:
        errs = exc.errors()
        first = errs[0].get("loc", ()) if errs else ()
        msgs = []
        for e in errs[:4]:
            where = ".".join(str(x) for x in e.get("loc", ())) or "body"
            msgs.append(f"{where}: {e.get('msg')}")
        raise OpenAIError(400, "invalid request: " + "; ".join(msgs),
                          param=str(first[0]) if first else None) from None
    req.check()
    return req


class OpenAIServing:
    """Turns OpenAI requests into batcher rows and the samples back into OpenAI answers."""

    def __init__(self, *, tokenizer, limits, vocab_size: int, max_positions: int,
                 model_name: str, generate: GenerateFn):
        self.tokenizer = tokenizer
        self.limits = limits
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.model_name = model_name
        self.aliases = {model_name, os.path.basename(os.path.normpath(model_name))}
        self.generate = generate
        self.created = int(time.time())

    # ---- checks ------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name not in self.aliases:
            raise OpenAIError(404, f"The model '{name}' does not exist; this server serves "
                                   f"'{self.model_name}' (GET /v1/models)", param="model",
                              code="model_not_found")

    def need_tokenizer(self):
        if self.tokenizer is None:
            raise OpenAIError(400, "the OpenAI API of this server needs a tokenizer in the model "
                                   "folder (or --tokenizer); without one use /generate with "
                                   "token ids")
        return self.tokenizer

    def encode(self, prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:  # one rule with /generate: "" is as empty as []
                raise OpenAIError(400, f"prompt {index} is empty", param="prompt")
            if len(prompt) > self.limits.max_prompt_tokens * 64:
                raise OpenAIError(400, f"prompt {index} is too long", param="prompt")
            ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            ids = list(prompt)
        if not ids:
            raise OpenAIError(400, f"prompt {index} is empty", param="prompt")
        if max(ids) >= self.vocab_size:
            raise OpenAIError(400, f"prompt {index} has token ids outside the vocab "
                                   f"[0, {self.vocab_size})", param="prompt")
        return ids

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise OpenAIError(400, "the model's tokenizer has no chat template; use "
                                   "/v1/completions", param="messages")
        messages = template_messages(req)
        try:
            text = tok.apply_chat_template(messages, tools=template_tools(req),
                                           add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - e.g. the template's raise_exception
            raise OpenAIError(400, f"the chat template refused the messages: {exc}",
                              param="messages") from None
        if len(text) > self.limits.max_prompt_tokens * 64:
            raise OpenAIError(400, "messages too long", param="messages")
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        prefix = forced_prefix(req)  # tool_choice required / named: the call's opening
        if prefix:
            ids += tok(prefix, add_special_tokens=False)["input_ids"]
        if not ids:
            raise OpenAIError(400, "the chat template rendered an empty prompt",
                              param="messages")
        return ids

    def check_sizes(self, prompts: list[list[int]], n: int, max_tokens: int | None,
                    max_tokens_field: str, prompt_field: str) -> int:
        """Apply the server limits; -> max_tokens (its default: what fits)."""
        lim = self.limits
        if n > lim.max_n:
            raise OpenAIError(400, f"n={n} is over this server's limit {lim.max_n}", param="n")
        if len(prompts) > lim.max_prompts:
            raise OpenAIError(400, f"{len(prompts)} prompts; this server's limit is "
                                   f"{lim.max_prompts}", param=prompt_field)
        if len(prompts) * n > lim.max_batch:
            raise OpenAIError(400, f"prompts x n = {len(prompts) * n} is over this server's "
                                   f"max_batch {lim.max_batch}", param="n")
        longest = max(len(p) for p in prompts)
        if longest > lim.max_prompt_tokens:
            raise OpenAIError(400, f"the prompt has {longest} tokens; this server's limit is "
                                   f"{lim.max_prompt_tokens}", param=prompt_field,
                              code="context_length_exceeded")
        if max_tokens is None:  # chat default: as much as fits
            max_tokens = min(lim.max_new_tokens, self.max_positions - longest)
            if max_tokens < 1:
                raise OpenAIError(400, f"the prompt has {longest} tokens: no room left in the "
                                       f"model's {self.max_positions} positions",
                                  param=prompt_field, code="context_length_exceeded")
        if max_tokens > lim.max_new_tokens:
            raise OpenAIError(400, f"{max_tokens_field}={max_tokens} is over this server's limit "
                                   f"{lim.max_new_tokens}", param=max_tokens_field)
        if longest + max_tokens > self.max_positions:
            raise OpenAIError(400, f"This model's maximum context length is "
                                   f"{self.max_positions} tokens; the prompt has {longest} and "
                                   f"{max_tokens_field} asks for {max_tokens}",
                              param=max_tokens_field, code="context_length_exceeded")
        return max_tokens

    # ---- generation --------------------------------------------------------------------------
    def sampling_params(self, req, max_tokens: int) -> SamplingParams:
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        return SamplingParams(
            n=1, max_new_tokens=max_tokens, greedy=temperature == 0,
            temperature=temperature if temperature > 0 else 1.0,
            top_p=1.0 if req.top_p is None else float(req.top_p), seed=req.seed,
            stop_token_ids=single_token_stops(self.tokenizer, req.stop_strings(),
                                              self.vocab_size))

    async def sample(self, prompts: list[list[int]], req, max_tokens: int, top_k: int):
        """-> per prompt a list of ``n`` finished samples (dicts), and the weight version."""
        rows = [ids for ids in prompts for _ in range(req.n)]
        samples, version = await self.generate(rows, self.sampling_params(req, max_tokens),
                                               top_k)
        return self.finish(samples, len(prompts), req), version

    def finish(self, samples: list[dict], n_prompts: int, req) -> list[list[dict]]:
        """The engine's samples (prompt-major rows) as the API returns them: text cut at the
        stop strings, per prompt a list of ``req.n``."""
        stops = req.stop_strings()
        out = []
        for i in range(n_prompts):
            group = []
            for s in samples[i * req.n:(i + 1) * req.n]:
                fin = finish_text(self.tokenizer, s["token_ids"], s["finish_reason"], stops)
                k = fin.n_tokens
                group.append({"text": fin.text, "pieces": fin.pieces,
                              "finish_reason": fin.finish_reason, "token_ids": s["token_ids"][:k],
                              "log_probs": s["log_probs"][:k],
                              "top": (s.get("top_logprobs") or [None] * k)[:k]})
            out.append(group)
        return out

    def usage(self, prompts, groups) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(len(s["token_ids"]) for g in groups for s in g)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    # ---- log-probs in the two answer formats --------------------------------------------------
    def completion_logprobs(self, s: dict, lo: int, hi: int, offset0: int) -> dict:
        tok = self.tokenizer
        tokens, top, offsets, at = [], [], [], offset0
        for i in range(lo, hi):
            tid = s["token_ids"][i]
            tokens.append(token_string(tok, tid))
            entry = {token_string(tok, t): lp for t, lp in (s["top"][i] or [])}
            entry.setdefault(tokens[-1], s["log_probs"][i])
            top.append(entry)
            offsets.append(at)
            at += len(s["pieces"][i])
        return {"tokens": tokens, "token_logprobs": s["log_probs"][lo:hi], "top_logprobs": top,
                "text_offset": offsets}

    def chat_logprobs(self, s: dict, lo: int, hi: int) -> dict:
        tok = self.tokenizer

        def item(tid, lp):
            text = token_string(tok, tid)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        content = []
        for i in range(lo, hi):
            entry = item(s["token_ids"][i], s["log_probs"][i])
            entry["top_logprobs"] = [item(t, lp) for t, lp in (s["top"][i] or [])]
            content.append(entry)
        return {"content": content, "refusal": None}


def openai_router(serving: OpenAIServing) -> APIRouter:
    """The ``/v1`` routes over ``serving``."""
    from parallel_models.inference.server.openai_stream import stream_response

    router = APIRouter()

    def model_card():
        return {"id": serving.model_name, "object": "model", "created": serving.created,
                "owned_by": "parallel_models", "max_model_len": serving.max_positions}

    @router.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        serving.check_model(model)
        return model_card()

    @router.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest)
        serving.check_model(req.model)
        serving.need_tokenizer()
        prompts = [serving.encode(p, i) for i, p in enumerate(req.prompts())]
        max_tokens = serving.check_sizes(prompts, req.n, req.max_tokens or 16, "max_tokens",
                                         "prompt")
        want_lp = req.logprobs is not None
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": serving.model_name}
        if req.stream:
            return await stream_response(serving, prompts, req, max_tokens, req.logprobs or 0,
                                         head, chat=False, logprobs=want_lp)
        groups, version = await serving.sample(prompts, req, max_tokens, req.logprobs or 0)
        choices = [{"index": c, "text": s["text"], "finish_reason": s["finish_reason"],
                    "logprobs": serving.completion_logprobs(s, 0, len(s["token_ids"]), 0)
                    if want_lp else None} for c, s in enumerate(s for g in groups for s in g)]
        return {**head, "system_fingerprint": f"weights-v{version}", "choices": choices,
                "usage": serving.usage(prompts, groups)}

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse(request, ChatCompletionRequest)
        serving.check_model(req.model)
        serving.need_tokenizer()
        check_tool_request(req)
        prompt = serving.chat_prompt(req)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else \
            "max_tokens"
        max_tokens = serving.check_sizes([prompt], req.n, req.max_new_tokens(), field,
                                         "messages")
        top_k = (req.top_logprobs or 0) if req.logprobs else 0
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": serving.model_name}
        if req.stream:
            return await stream_response(serving, [prompt], req, max_tokens, top_k,
                                         {**head, "object": "chat.completion.chunk"},
                                         chat=True, logprobs=bool(req.logprobs))
        groups, version = await serving.sample([prompt], req, max_tokens, top_k)
        choices = []
        for c, s in enumerate(groups[0]):
            message, calls = assistant_message(forced_prefix(req) + s["text"], tool_mode(req),
                                               parallel=req.parallel_tool_calls is not False)
            choices.append({"index": c, "message": message,
                            "logprobs": serving.chat_logprobs(s, 0, len(s["token_ids"]))
                            if req.logprobs else None,
                            "finish_reason": "tool_calls" if calls else s["finish_reason"]})
        return {**head, "system_fingerprint": f"weights-v{version}", "object": "chat.completion",
                "choices": choices, "usage": serving.usage([prompt], groups)}

    return router


__all__ = ["OpenAIServing", "openai_router"]
