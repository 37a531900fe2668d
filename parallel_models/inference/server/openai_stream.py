"""Streaming answers of the OpenAI-compatible API: server-sent events as tokens are drawn.

The request's rows go to the batcher with a sink; generation's per-step hook (run on the
batcher thread) hands each step's new tokens to the event loop, and every choice gets a chunk
per token whose text is complete (``data: {chunk}\\n\\n``; chat: a first chunk with the role).
Text that may still turn into a stop string is held back until it is known not to; a choice
ends at the first stop string completed, as in the non-streamed answer. When generation is done
each choice gets a chunk with its ``finish_reason`` (and any text the incremental decoding still
held), and with ``stream_options.include_usage`` a last chunk with ``choices: []`` and the usage
(the other chunks then carry ``"usage": null``); ``data: [DONE]`` ends the stream. The text
concatenated over the chunks equals the non-streamed answer's (same decoding, same cut). An
error after the stream began is sent as an event ``{"error": {...}}`` (the OpenAI client raises
it).
"""

from __future__ import annotations

import asyncio
import json
import logging

from parallel_models.inference.server.openai_protocol import error_body
from parallel_models.inference.server.openai_text import (IncrementalDetokenizer, first_stop,
                                                           held_back)

log = logging.getLogger(__name__)


def sse(data) -> str:
    """One server-sent event: ``data: <json or text>`` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n"


class ChoiceText:
    """One choice's text as its tokens arrive: what may be sent now, where it stops."""

    def __init__(self, tokenizer, stop_strings: list[str]):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = stop_strings
        self.text = ""
        self.sent = 0
        self.done = False

    def add(self, token_id: int) -> tuple[str, str, int]:
        """-> (text to send now, the token's piece, offset of the piece in the text)."""
        offset = len(self.text)
        piece = self.detok.add(token_id)
        self.text += piece
        cut = first_stop(self.text, self.stops)
        if cut is not None:
            self.done = True
            end = cut[0]
        else:
            end = len(self.text) - held_back(self.text, self.stops)
        delta = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta, piece, offset


async def stream_response(serving, prompts: list[list[int]], req, max_tokens: int, top_k: int,
                          head: dict, *, chat: bool, logprobs: bool):
    """The ``StreamingResponse`` of a completions (``chat=False``) or chat request."""
    from starlette.responses import StreamingResponse

    head = {**head, "system_fingerprint": None}  # the weight version is known at the end only
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def sink(step):  # on the batcher thread
        loop.call_soon_threadsafe(queue.put_nowait, step)

    rows = [ids for ids in prompts for _ in range(req.n)]
    result = asyncio.ensure_future(
        serving.generate(rows, serving.sampling_params(req, max_tokens), top_k, sink))
    await asyncio.sleep(0)
    if result.done() and result.exception() is not None:  # refused at once (shutting down)
        raise result.exception()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    texts = [ChoiceText(serving.tokenizer, req.stop_strings()) for _ in rows]

    def chunk(index: int, text: str | None, lp, finish: str | None, first: bool = False):
        if chat:
            delta = {"role": "assistant", "content": ""} if first else \
                ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": lp,
                      "finish_reason": finish}
        out = {**head, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return sse(out)

    def step_chunks(step) -> list[str]:
        out = []
        for r, item in enumerate(step):
            if item is None or texts[r].done:
                continue
            token_id, logp, top = item
            delta, piece, offset = texts[r].add(token_id)
            lp = None
            if logprobs:
                one = {"token_ids": [token_id], "log_probs": [logp], "top": [top],
                       "pieces": [piece]}
                lp = serving.chat_logprobs(one, 0, 1) if chat else \
                    serving.completion_logprobs(one, 0, 1, offset)
            if delta or lp is not None:
                out.append(chunk(r, delta, lp, None))
        return out

    async def events():
        try:
            if chat:
                for r in range(len(rows)):
                    yield chunk(r, None, None, None, first=True)
            while True:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, result}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    break
                for event in step_chunks(getter.result()):
                    yield event
            while not queue.empty():  # steps handed over before the result
                for event in step_chunks(queue.get_nowait()):
                    yield event
            samples, version = result.result()
        except Exception as exc:  # noqa: BLE001 - the answer has begun: report in the stream
            status = getattr(exc, "status", 422 if isinstance(exc, ValueError) else 500)
            message = getattr(exc, "message", None) or str(exc)
            if status >= 500:  # the log has the cause; the answer never carries exception text
                log.exception("streamed generation failed")
                message = getattr(exc, "message", None) or "internal error (see the server log)"
            yield sse(error_body(400 if status == 422 else status, message))
            yield sse("[DONE]")
            return
        groups = serving.finish(samples, len(prompts), req)
        for r, s in enumerate(sample for group in groups for sample in group):
            sent = texts[r].text[:texts[r].sent]
            rest = s["text"][len(sent):] if s["text"].startswith(sent) else ""
            yield chunk(r, rest, None, s["finish_reason"])
        if include_usage:
            yield sse({**head, "choices": [], "usage": serving.usage(prompts, groups)})
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


__all__ = ["ChoiceText", "sse", "stream_response"]
