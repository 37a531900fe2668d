"""The rollout server's batcher in continuous mode: one thread runs the continuous engine.

Requests arriving while others decode join the running batch at the next step (no batch window):
each loop turn takes every queued job, turns its rows into engine requests (consecutive identical
rows = one request of n samples, so they share one prefill) and runs one engine step on every
rank (``Engine.run_cstep`` broadcasts the new requests with the step). A job's future resolves
when its last sample finishes; a streamed job's sink sees each token as it is drawn. A request
that can never fit the KV budget is refused in :meth:`submit` (the HTTP handler answers 4xx at
once). A weight update waits until the running rows finish (they keep the old weights), then
runs; jobs queued behind it start on the new weights. With ``--partial-rollouts`` it runs at
once, between two steps, and the running rows go on under the new weights, each token's
version recorded (``server/partial_rollout.py``). Per-prompt seeds and response caps
(``prompt_seeds``, ``prompt_max_new_tokens``) make each prompt a request of its own. A request
for MoE routes
(``return_routes``) runs the same way, alone through the static ``generate`` that records them.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import random

from parallel_models.inference.continuous import request_seed
from parallel_models.inference.scheduler import KVBudgetError
from parallel_models.inference.server.app import ApiError, Batcher
from parallel_models.inference.server.partial_rollout import TokenVersions

log = logging.getLogger(__name__)


def _groups(rows: list[list[int]]) -> list[tuple[list[int], int]]:
    """Consecutive identical rows as (prompt, count)."""
    return [(row, len(list(run))) for row, run in itertools.groupby(rows)]


@dataclasses.dataclass(eq=False)
class _Running:
    job: object
    requests: list = dataclasses.field(default_factory=list)
    left: int = 0
    versions: list = dataclasses.field(default_factory=list)  # partial rollouts: TokenVersions


class ContinuousBatcher(Batcher):
    def __init__(self, engine, limits):
        super().__init__(engine, limits)
        self.continuous = engine.rollout.continuous_engine()
        self._active: list[_Running] = []

    def submit(self, kind: str, payload, rows: int = 0):
        if kind == "generate":
            rows_, params = payload[0], payload[1]
            for prompt, n in _groups(rows_):
                try:
                    self.continuous.scheduler.check(n, len(prompt) + params.max_new_tokens)
                except KVBudgetError as exc:
                    raise ApiError(422, str(exc)) from None
        return super().submit(kind, payload, rows)

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self):
        stopping = False
        while True:
            jobs = []
            if not self.continuous.has_work and not stopping:
                jobs.append(self._next())
            while True:
                try:
                    jobs.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            subs: list = []
            for job in jobs:
                if job is None:
                    stopping = True
                    continue
                if not job.future.set_running_or_notify_cancel():
                    continue  # timed out while queued
                if job.kind == "update" or _wants_routes(job):
                    self._step(subs)
                    subs = []
                    in_flight = job.kind == "update" and self.engine.partial_rollouts
                    while self.continuous.has_work and not in_flight:  # rows end on the old
                        self._step([])                                  # weights
                    if job.kind == "update":
                        self._finish([job], lambda: [self.engine.update_weights(job.payload)])
                    else:  # MoE routes are recorded by the static generate: run it alone
                        self._finish([job], lambda: self._generate([job]))
                    continue
                subs.extend(self._requests_of(job))
            if subs or self.continuous.has_work:
                self._step(subs)
            if stopping and not self.continuous.has_work:
                break
        self._cancel_queued()

    def _requests_of(self, job) -> list:
        rows, params, top_k, sink = job.payload[:4]
        seeds = job.payload[5] if len(job.payload) > 5 else None  # /generate's prompt_seeds
        caps = job.payload[6] if len(job.payload) > 6 else None  # prompt_max_new_tokens
        if params.seed is None and not params.greedy:  # rank 0 picks it: every rank the same
            params = params.model_copy(update={"seed": random.getrandbits(62)})
        per_prompt = seeds if seeds is not None else caps
        if per_prompt is not None:  # n rows per prompt, each prompt its own seed / cap
            n = len(rows) // len(per_prompt)
            groups = [(rows[i * n], n) for i in range(len(per_prompt))]
        else:
            groups = _groups(rows)
        state = _Running(job, [None] * len(groups), len(groups), [None] * len(groups))
        self._active.append(state)
        subs, start = [], 0
        for i, (prompt, n) in enumerate(groups):
            seed = request_seed(params.seed, i) if seeds is None else seeds[i]
            p = params.model_copy(update={"n": n, "seed": seed} if caps is None else
                                  {"n": n, "seed": seed, "max_new_tokens": caps[i]})
            subs.append(((prompt, p, top_k), self._hooks(state, i, start, len(rows), sink, n)))
            start += n
        return subs

    def _hooks(self, state: _Running, i: int, start: int, total: int, sink, n: int):
        on_token = None
        if sink is not None:
            def on_token(index, token, logp, top):
                step = [None] * total
                step[start + index] = (token, logp, top)
                try:  # a listener gone must not fail the batch
                    sink(step)
                except Exception:  # noqa: BLE001
                    log.debug("a stream listener failed", exc_info=True)

        if self.engine.partial_rollouts:  # each token's weight version (partial_rollout.py)
            state.versions[i] = TokenVersions(n, lambda: self.engine.version, on_token)
            on_token = state.versions[i].record

        def on_done(request):
            state.requests[i] = request
            state.left -= 1
            if state.left == 0:
                self._active.remove(state)
                state.job.future.set_result((_samples(state.requests, state.versions),
                                             self.engine.version))

        return on_token, on_done

    def _step(self, subs: list) -> None:
        try:
            self.engine.run_cstep([s for s, _ in subs], [h for _, h in subs])
        except Exception as exc:  # noqa: BLE001 - report to the callers, keep serving
            log.exception("engine step failed")
            self.engine.reset_continuous()
            for state in self._active:
                if not state.job.future.done():
                    state.job.future.set_exception(exc)
            self._active.clear()


def _wants_routes(job) -> bool:
    """A /generate job asking for MoE routes (its payload's optional fifth item)."""
    return job.kind == "generate" and len(job.payload) > 4 and bool(job.payload[4])


def _samples(requests, versions) -> list[dict]:
    out = []
    for req, token_versions in zip(requests, versions):
        for j, s in enumerate(req.samples):
            d = {"token_ids": s.token_ids, "log_probs": s.log_probs,
                 "finish_reason": s.finish_reason}
            if token_versions is not None:
                d["weight_versions"] = token_versions.versions[j]
            if s.top_logprobs is not None:
                d["top_logprobs"] = s.top_logprobs
            out.append(d)
    return out


__all__ = ["ContinuousBatcher"]
