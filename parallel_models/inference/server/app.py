"""HTTP front of the rollout server (rank 0): FastAPI app + request batcher.

Endpoints (JSON; who may call which, the API key and the admin endpoints: ``security.py``):

- ``GET /health`` -> ``{"status": "ok", "weight_version": v}``
- ``GET /info`` -> model path, architecture, TP, dtype, vocab size, weight version, limits, stats
- ``POST /generate`` body ``{"prompts": [str | [int, ...], ...], "return_text": true}`` plus
  the fields of :class:`~parallel_models.inference.sampling.SamplingParams` (``"n": 1,
  "max_new_tokens": 16, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "greedy": false,
  "seed": null, "stop_token_ids": [], "eos_token_id": null, "ignore_eos": false``; EOS defaults
  to the server tokenizer's; ``temperature`` <= 100, ``seed`` in [0, 2^62); ``"prompt_seeds":
  [s, ...]`` seeds each prompt's samples on their own and ``"prompt_max_new_tokens": [m, ...]``
  caps them (``native_protocol.py``); an empty prompt,
  ``""`` or ``[]``, is refused) -> ``{"weight_version": v,
  "results": [{"prompt_token_ids": [...], "samples": [{"token_ids", "log_probs",
  "finish_reason": "stop"|"length", "text"?, "routes"?}] * n}]}``; ``"return_routes": true``
  (MoE models) adds per sample ``routes``: for every prompt and generated token, per MoE layer,
  the top-k experts it was routed to (-1: never routed, the last generated token). Text prompts need a tokenizer in the
  model folder (encoded with its special tokens, e.g. BOS). Log-probs are
  ``log_softmax(logits / temperature)`` of the drawn tokens (see ``rl.rollout.generation``).
- ``POST /update_weights`` body ``{"path": folder}`` (HF safetensors or megatron-core checkpoint)
  -> ``{"weight_version": v, ...}``; a folder whose config.json or tensors do not match the
  served model is refused first (400 naming the field, ``weight_folder.py``); runs between
  batches, so requests already batched finish on the old weights and the version moves by one. Atomic: if loading fails on any rank
  (read error, out of memory, mismatch), the old weights stay bit-identical, the version does
  not move and the answer is 400 with the cause.
- ``POST /update_weights_stream`` body: the weights as a stream of frames
  (``weight_stream.py``; no size limit) -> the same answer as ``/update_weights``; a stream cut
  short or a tensor that does not fit the model: 400, the old weights and version kept.
- ``POST /weights_group/init``, ``POST /weights_group/update``, ``GET /weights_group/status``:
  weights broadcast by the trainer over a process group (``weight_group.py``).
- ``POST /shutdown`` -> graceful exit (in-flight requests finish); SIGTERM/SIGINT do the same.
- The OpenAI-compatible API: ``GET /v1/models``, ``POST /v1/completions``,
  ``POST /v1/chat/completions`` (``openai_api``), batched with the requests above; its errors
  (everything under ``/v1/``, the 401 / 404 / 413 ones included) have the OpenAI body
  ``{"error": {"message", "type", "param", "code"}}`` and 400 where the native API says 422.

Errors of the native endpoints are ``{"error": message}`` with: 400 malformed JSON (NaN /
Infinity, lone surrogates, nesting too deep included) / bad path / text prompt without a
tokenizer / Host not this server, 401 missing or wrong API key, 403 Origin not allowed or admin
endpoint disabled, 404/405 unknown route/method, 413 body too large, 415 not JSON, 422 wrong
types or out-of-range values (prompt too long, n / max_new_tokens / batch rows over the limits,
token ids outside the vocab), 503 shutting down, 504 request timeout, 500 internal (the cause
is in the server log, never in the answer).

Continuous batching (the server's default, ``continuous_batcher``): requests join the running batch at
the next decode step and leave it when done (``continuous_batcher``); one that can never fit the
KV budget gets 422 (OpenAI routes: 400) at once. With ``--static-batching``: requests arriving
within ``batch_window_ms`` of the first queued one are generated
together, up to ``max_batch`` rows (prompts x n). Rows with the same sampling params share one
``generate`` call; a request with a ``seed`` or ``prompt_seeds`` gets its own call (and
generator), so its samples are reproducible. ``generate`` is row-independent, so greedy results
do not depend on the batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any

from fastapi import FastAPI, Request

from parallel_models.inference.server.engine import Engine, GenCall
from parallel_models.inference.server.http_guards import (BadBody, BodyLimit, error_response,
                                                           is_openai, parse_json_body)
from parallel_models.inference.server.native_protocol import (  # noqa: F401 - re-exported
    MAX_TEMPERATURE, GenerateRequest, UpdateWeightsRequest)
from parallel_models.inference.server.openai_protocol import OpenAIError
from parallel_models.inference.server.security import AccessGuard, ServerSecurity, with_cors

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ServerLimits:
    max_batch: int = 64
    batch_window_ms: float = 5.0
    max_prompt_tokens: int = 1024
    max_new_tokens: int = 512
    max_n: int = 16
    max_prompts: int = 64
    max_body_bytes: int = 4 << 20
    request_timeout_s: float = 300.0


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclasses.dataclass
class _Job:
    kind: str                      # "generate" | "update"
    payload: Any
    future: concurrent.futures.Future
    rows: int = 0


class Batcher:
    """One thread owns the model: it collects generate jobs for a short window and runs them."""

    def __init__(self, engine: Engine, limits: ServerLimits):
        self.engine = engine
        self.limits = limits
        self.queue: queue.Queue = queue.Queue()
        self._held: _Job | None = None
        self._thread = threading.Thread(target=self._run, name="rollout-batcher", daemon=True)
        self.closed = False

    def start(self):
        self._thread.start()

    def submit(self, kind: str, payload, rows: int = 0) -> concurrent.futures.Future:
        if self.closed:
            raise ApiError(503, "server is shutting down")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.queue.put(_Job(kind, payload, fut, rows))
        return fut

    def close(self, timeout: float = 60.0):
        self.closed = True
        self.queue.put(None)
        self._thread.join(timeout)

    def _next(self, timeout=None):
        if self._held is not None:
            job, self._held = self._held, None
            return job
        return self.queue.get(timeout=timeout) if timeout is not None else self.queue.get()

    def _run(self):
        while True:
            job = self._next()
            if job is None:
                break
            if not job.future.set_running_or_notify_cancel():
                continue  # timed out while queued
            if job.kind == "update":
                self._finish([job], lambda: [self.engine.update_weights(job.payload)])
                continue
            batch, rows = [job], job.rows
            deadline = time.monotonic() + self.limits.batch_window_ms / 1000
            while rows < self.limits.max_batch:
                try:
                    nxt = self._next(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None or nxt.kind != "generate" or rows + nxt.rows > self.limits.max_batch:
                    self._held = nxt
                    break
                if nxt.future.set_running_or_notify_cancel():
                    batch.append(nxt)
                    rows += nxt.rows
            self._finish(batch, lambda: self._generate(batch))
        self._cancel_queued()

    def _cancel_queued(self) -> None:
        """Fail every job still queued with a 503 (the server is stopping)."""
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(ApiError(503, "server is shutting down"))

    def _finish(self, jobs, fn):
        try:
            results = fn()
        except Exception as exc:  # noqa: BLE001 - report to the callers, keep serving
            log.exception("batch failed")
            for j in jobs:
                j.future.set_exception(exc)
            return
        for j, r in zip(jobs, results):
            j.future.set_result(r)

    def _generate(self, batch: list[_Job]) -> list[list[list[dict]]]:
        # group rows by (sampling params) for unseeded requests; seeded ones run alone
        calls: list[GenCall] = []
        where: list[list[tuple[int, int, int]]] = []  # per job: (call, start, count) pieces
        by_key: dict = {}
        sinks: dict[int, list] = {}  # call -> [(start, count, sink)] of streamed jobs
        for job in batch:
            rows, params, top_k, sink, *extra = job.payload  # params: one sample per row (n=1)
            routes = bool(extra and extra[0])  # /generate's return_routes
            seeds = extra[1] if len(extra) > 1 else None  # /generate's prompt_seeds
            caps = extra[2] if len(extra) > 2 else None  # /generate's prompt_max_new_tokens
            if params.seed is None and seeds is None and caps is None:
                key = (params.sampling_key(), top_k, routes)
                if key not in by_key:
                    by_key[key] = len(calls)
                    calls.append(GenCall([], params, top_k, routes))
                ci = by_key[key]
            else:
                ci = len(calls)
                calls.append(GenCall([], params, top_k, routes, seeds, caps))
            where.append((ci, len(calls[ci].rows), len(rows)))
            if sink is not None:
                sinks.setdefault(ci, []).append((len(calls[ci].rows), len(rows), sink))
            calls[ci].rows.extend(rows)
        hooks = [_stream_hook(sinks[ci]) if ci in sinks else None for ci in range(len(calls))]
        outs = self.engine.run_generate(calls, hooks)
        version = self.engine.version  # same thread as updates: the weights these rows used
        return [(outs[ci][start:start + count], version) for ci, start, count in where]


def _stream_hook(sinks: list):
    """A generate ``on_step`` handing each streamed job its rows' new tokens: a list with, per
    row, ``(token_id, log_prob, [[id, log_prob], ...] | None)`` or None (row already done)."""

    def hook(tokens, log_probs, produced, top):
        ids, logps, made = tokens.tolist(), log_probs.float().tolist(), produced.tolist()
        tops = None
        if top is not None:
            tops = [[list(p) for p in zip(i, v)]
                    for i, v in zip(top[0].tolist(), top[1].float().tolist())]
        for start, count, sink in sinks:
            try:  # a listener gone (client or event loop closed) must not fail the batch
                sink([(ids[r], logps[r], tops[r] if tops else None) if made[r] else None
                      for r in range(start, start + count)])
            except Exception:  # noqa: BLE001
                log.debug("a stream listener failed", exc_info=True)

    return hook


def create_app(engine: Engine, tokenizer, limits: ServerLimits, api_key: str | None = None,
               model_info: dict | None = None, batcher_cls=None,
               security: ServerSecurity | None = None):
    """The FastAPI app over ``engine`` (rank 0). Start its batcher in the lifespan.
    ``batcher_cls``: :class:`Batcher` (default) or ``continuous_batcher.ContinuousBatcher``;
    ``security``: who may call what (default: ``ServerSecurity(api_key=api_key)``, loopback)."""
    from contextlib import asynccontextmanager

    from fastapi.exceptions import RequestValidationError

    from parallel_models.inference.server.openai_api import OpenAIServing, openai_router
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.responses import JSONResponse

    security = security or ServerSecurity(api_key=api_key)
    batcher = (batcher_cls or Batcher)(engine, limits)
    config = engine.model.config
    vocab_size = int(config.vocab_size)
    max_pos = int(getattr(config, "max_position_embeddings", 1 << 30))
    eos = engine.rollout.eos_token_id  # the default EOS of requests (the tokenizer's)
    state = {"server": None, "started": time.time(), "requests": 0}

    @asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        batcher.close()

    # interactive docs at /docs (the schema at /openapi.json); open without the API key, like
    # /health: they describe the API, they do not use it
    app = FastAPI(title="parallel_models rollout server", lifespan=lifespan,
                  docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.batcher = batcher
    app.state.engine = engine
    app.state.ctl = state

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return error_response(request.url.path, exc.status, exc.message)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request, exc: OpenAIError):
        return error_response(request.url.path, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        errs = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errs):
            return error_response(request.url.path, 400, "malformed JSON body")
        msgs = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: "
                f"{e.get('msg')}" for e in errs[:10]]
        return error_response(request.url.path, 422, "invalid request: " + "; ".join(msgs))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        message = str(exc.detail)
        if is_openai(request.url.path):
            message = f"{message}: {request.method} {request.url.path}"
        return error_response(request.url.path, exc.status_code, message)

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        log.exception("internal error")  # the cause stays in the log, not in the answer
        return error_response(request.url.path, 500, "internal error (see the server log)")

    async def _wait(fut):
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), limits.request_timeout_s)
        except asyncio.TimeoutError:
            fut.cancel()
            raise ApiError(504, f"request timed out after {limits.request_timeout_s:g}s") from None
        except ApiError:
            raise
        except ValueError as exc:
            raise ApiError(422, str(exc)) from None

    @app.get("/health")
    async def health():
        if batcher.closed:
            return JSONResponse({"status": "shutting down"}, 503)
        return {"status": "ok", "weight_version": engine.version}

    @app.get("/info")
    async def info():
        return {**(model_info or {}), "tp": engine.tp, "weight_version": engine.version,
                "weights_path": engine.weights_path, "vocab_size": vocab_size,
                "max_position_embeddings": max_pos, "has_tokenizer": tokenizer is not None,
                "eos_token_id": eos, "limits": dataclasses.asdict(limits),
                "stats": {"requests": state["requests"], "batches": engine.batches,
                          "generated_tokens": engine.generated_tokens,
                          "uptime_s": round(time.time() - state["started"], 1),
                          **engine.continuous_stats()},
                "last_weight_push": state.get("last_push")}

    def _encode(prompt) -> list[int]:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ApiError(400, "text prompts need a tokenizer in the model folder; "
                                    "send token ids")
            if len(prompt) > limits.max_prompt_tokens * 64:
                raise ApiError(422, "prompt text too long")
            return list(tokenizer(prompt)["input_ids"])
        return list(prompt)

    async def _parse(request: Request, model_cls):
        from pydantic import ValidationError

        try:
            data = parse_json_body(await request.body())
        except BadBody as exc:
            raise ApiError(400, str(exc)) from None
        try:
            return model_cls.model_validate(data)
        except ValidationError as exc:
            msgs = [f"{'.'.join(str(x) for x in e.get('loc', ())) or 'body'}: {e.get('msg')}"
                    for e in exc.errors()[:10]]
            raise ApiError(422, "invalid request: " + "; ".join(msgs)) from None

    @app.post("/generate")
    async def generate_endpoint(request: Request):
        req = await _parse(request, GenerateRequest)
        state["requests"] += 1
        if req.n > limits.max_n:
            raise ApiError(422, f"n={req.n} is over the limit {limits.max_n}")
        if req.max_new_tokens > limits.max_new_tokens:
            raise ApiError(422, f"max_new_tokens={req.max_new_tokens} is over the limit "
                                f"{limits.max_new_tokens}")
        if len(req.prompts) > limits.max_prompts:
            raise ApiError(422, f"{len(req.prompts)} prompts; the limit is {limits.max_prompts}")
        rows_total = len(req.prompts) * req.n
        if rows_total > limits.max_batch:
            raise ApiError(422, f"prompts x n = {rows_total} is over max_batch {limits.max_batch}")
        if req.return_routes and not engine.model.config.is_moe:
            raise ApiError(422, "return_routes: the model has no MoE layer (no routes to return)")
        bad_stop = [t for t in req.stop_token_ids if not 0 <= t < vocab_size]
        if bad_stop:
            raise ApiError(422, f"stop_token_ids outside the vocab [0, {vocab_size}): {bad_stop}")
        eos_ids = req.eos_token_id if isinstance(req.eos_token_id, list) else [req.eos_token_id]
        if any(t is not None and t >= vocab_size for t in eos_ids):
            raise ApiError(422, f"eos_token_id outside the vocab [0, {vocab_size}): "
                                f"{req.eos_token_id}")
        encoded = []
        for i, p in enumerate(req.prompts):
            ids = _encode(p) if p != "" else []  # one rule: "" is as empty as []
            if not ids:
                raise ApiError(422, f"prompt {i} is empty")
            if len(ids) > limits.max_prompt_tokens:
                raise ApiError(422, f"prompt {i} has {len(ids)} tokens; the limit is "
                                    f"{limits.max_prompt_tokens}")
            if len(ids) + req.max_new_tokens > max_pos:
                raise ApiError(422, f"prompt {i}: {len(ids)} tokens + max_new_tokens "
                                    f"{req.max_new_tokens} exceed the model's {max_pos} positions")
            if min(ids) < 0 or max(ids) >= vocab_size:
                raise ApiError(422, f"prompt {i} has token ids outside the vocab [0, {vocab_size})")
            encoded.append(ids)
        # the app repeats the rows n times itself, so requests with different n share a call
        params = req.sampling().model_copy(update={"n": 1})
        rows = [ids for ids in encoded for _ in range(req.n)]
        samples, version = await _wait(batcher.submit(
            "generate", (rows, params, 0, None, req.return_routes, req.prompt_seeds,
                         req.prompt_max_new_tokens), len(rows)))
        results = []
        for i, ids in enumerate(encoded):
            group = samples[i * req.n:(i + 1) * req.n]
            if req.return_text and tokenizer is not None:
                for s in group:
                    s["text"] = tokenizer.decode(s["token_ids"], skip_special_tokens=True)
            results.append({"prompt_token_ids": ids, "samples": group})
        return {"weight_version": version, "results": results}

    @app.post("/update_weights")
    async def update_weights(request: Request):
        import os

        req = await _parse(request, UpdateWeightsRequest)

        if not os.path.isdir(req.path):
            raise ApiError(400, f"{req.path!r} is not a folder on the server")
        from parallel_models.inference.server.weight_folder import (WeightFolderError,
                                                                     check_weight_folder)

        try:
            await asyncio.to_thread(check_weight_folder, req.path, engine.model)
        except WeightFolderError as exc:
            raise ApiError(400, f"{req.path!r}: {exc}; version {engine.version} kept") from None
        try:
            return await _wait(batcher.submit("update", req.path))
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ApiError(400, f"could not load weights from {req.path!r}: "
                                f"{type(exc).__name__}: {exc}") from None

    @app.post("/update_weights_stream")
    async def update_weights_stream(request: Request):
        from parallel_models.inference.server.weight_stream import (WeightStreamError,
                                                                     receive_weight_stream)

        t0 = time.perf_counter()
        try:
            reader = await receive_weight_stream(request, engine)
        except WeightStreamError as exc:
            raise ApiError(400, str(exc)) from None
        received = round(time.perf_counter() - t0, 3)
        try:
            answer = await _wait(batcher.submit("update", reader))
            state["last_push"] = {**answer, "receive_seconds": received}
            return {**answer, "receive_seconds": received}
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ApiError(400, f"could not load the pushed weights: {type(exc).__name__}: "
                                f"{exc}") from None

    async def _openai_generate(rows, params, top_logprobs, sink=None):
        state["requests"] += 1
        return await _wait(batcher.submit("generate", (rows, params, top_logprobs, sink),
                                          len(rows)))

    name = (model_info or {}).get("model") or engine.model_path or "model"
    app.include_router(openai_router(OpenAIServing(
        tokenizer=tokenizer, limits=limits, vocab_size=vocab_size, max_positions=max_pos,
        model_name=str(name), generate=_openai_generate)))

    from parallel_models.inference.server.weight_group import group_router

    app.include_router(group_router(engine, lambda job: batcher.submit("update", job), state,
                                    security))

    @app.post("/shutdown")
    async def shutdown():
        server = state.get("server")
        if server is None:
            raise ApiError(503, "no server handle to stop")
        server.should_exit = True
        return {"status": "shutting down"}

    with_cors(app, security)
    guarded = AccessGuard(BodyLimit(app, limits.max_body_bytes, ("/update_weights_stream",)),
                          security)
    return guarded, app, state
