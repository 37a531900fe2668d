"""Continuous batching: requests join and leave the decode batch step by step.

:class:`ContinuousEngine` keeps a set of running samples (rows). Each :meth:`step` admits the
waiting requests that fit (``scheduler.Scheduler``: a KV budget in tokens, FIFO; a request that
can never fit raises :class:`~parallel_models.inference.scheduler.KVBudgetError` at
:meth:`submit`), prefills their prompts packed, **once per request** (the prompt KV is copied into
its n samples' regions, ``pool_cache.PoolKVCache.copy``, and into those of any other request
with the same prompt admitted in the same step; with ``prefix_cache_tokens`` an
identical prompt seen before skips the prefill, ``prefix_cache.PrefixCache``), then runs one
decode step of every running row. A finished row leaves at once and frees its region and row.

Multi-turn re-entry: a request submitted with ``keep_kv=True`` (n=1) keeps its region when it
finishes (``request.kept``, a ``scheduler.KeptKV``; its row is freed); a later request whose
prompt extends those tokens, submitted with ``resume=request.kept``, prefills only its new
tokens (``kv_extend``), their attention reading the kept KV. Give a kept region back with
:meth:`ContinuousEngine.release_kept`. Not in exact mode nor for models whose rotary embedding
depends on the length (those prefill the whole prompt again, into the kept region).

The decode batch is padded up to a bucket size (powers of two up to ``max_rows``); on CUDA with
flash decoding each bucket's step is captured in a CUDA graph once and replayed for the engine's
lifetime, whatever rows it holds (the rows' tokens, regions and lengths live in the bucket's
fixed buffers, ``pool_cache.DecodeRows``). Rows draw with per-row counter-based noise
(``row_sampling``), so a request's samples do not depend on what else runs; a request without a
``seed`` gets one from ``generator`` (else the global generator) when submitted.

TP: every rank of a TP group must submit the same requests in the same order between the same
steps (the in-process trainer does; the server mirrors rank 0's commands); the drawn tokens are
broadcast from TP rank 0, so the ranks' schedules stay identical. Pipeline parallel is not
supported (as in ``generation.generate``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import torch

from parallel_models.inference.bucket_step import BucketStep, bucket_sizes
from parallel_models.inference.continuous_output import generation_output, request_seed
from parallel_models.inference.decode_layout import DecodeLayout, build_layout, sampling_of
from parallel_models.inference.generation import (_broadcast_in_tp_group,
                                                  check_generation_layout, sequence_parallel_off)
from parallel_models.inference.kv_extend import prefill_extensions
from parallel_models.inference.pool_cache import DecodeRows, PoolKVCache
from parallel_models.inference.prefix_cache import PrefixCache
from parallel_models.inference.row_sampling import draw, row_seed
from parallel_models.inference.sampling import SamplingParams
from parallel_models.inference.scheduler import KeptKV, KVBudgetError, Scheduler
from parallel_models.inference.stop_sequences import (check_stop_sequences,
                                                      ends_with_stop_sequence)
from parallel_models.llama.layers import exact
from parallel_models.options import option

DEFAULT_MAX_PREFILL_TOKENS = 16384  # prompt tokens per prefill pack (the memory plan may lower it)
# a re-entry with at most this many new tokens runs them in the next decode step (decode_layout)
DEFAULT_DECODE_EXTENSION_TOKENS = 64

@dataclasses.dataclass
class Sample:
    token_ids: list = dataclasses.field(default_factory=list)
    log_probs: list = dataclasses.field(default_factory=list)
    top_logprobs: list | None = None   # per token: [[id, log-prob], ...] with top_logprobs=k
    finish_reason: str | None = None   # "stop" | "length" once finished


@dataclasses.dataclass(eq=False)
class Request:
    """``params.n`` samples of ``prompt``; ``samples`` fill in as they are drawn."""

    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset
    top_logprobs: int
    seed: int
    on_token: Callable | None = None   # (sample index, token, log-prob, top pairs | None)
    on_done: Callable | None = None    # (request) once every sample finished
    stop_sequences: tuple = ()         # token-id tuples that end a sample (stop_sequences.py)
    samples: list = dataclasses.field(default_factory=list)
    rows_left: int = 0
    keep_kv: bool = False              # keep the region when it finishes (``kept``)
    resume: KeptKV | None = None       # the kept region whose tokens the prompt extends
    kept: KeptKV | None = None         # with keep_kv, once finished
    extend_from: int = 0               # set at admission: KV positions kept (scheduler.py)
    moved_from: int | None = None      # set at admission: the kept region to copy them from

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def row_tokens(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def done(self) -> bool:
        return self.rows_left == 0 and bool(self.samples)


@dataclasses.dataclass(eq=False)
class _Row:
    request: Request
    index: int
    offset: int
    length: int       # KV positions filled
    seed: int
    token: int = 0    # the last drawn token, fed by the next decode step
    generated: int = 0
    feed: list | None = None  # a re-entry's new tokens, run by the next decode step instead


@dataclasses.dataclass(eq=False)
class _Drawn:
    """The tokens drawn for ``rows`` by one step, on their way to the host: ``host`` (``[2, B]``
    tokens, log-probs) is filled by an asynchronous copy that ``ready`` marks done."""

    rows: list
    layout: DecodeLayout | None
    host: torch.Tensor
    ready: object
    top: tuple | None


class ContinuousEngine:
    """``ContinuousEngine(model, kv_budget_tokens, max_rows=64, max_row_tokens=None,
    prefix_cache_tokens=0, max_prefill_tokens=16384)``: KV pool of ``kv_budget_tokens``
    positions (this rank's heads), at most ``max_rows`` samples decoding at once, at most
    ``max_row_tokens`` positions (prompt + new tokens) per sample (default: the budget, capped by
    the model's positions); prompts starting together are prefilled in packs of at most
    ``max_prefill_tokens`` tokens; a resumed request with at most ``decode_extension_tokens``
    new tokens runs them in the next decode step instead (``decode_layout``; 0: never).
    ``pipeline`` (default: the option ``decode_pipeline``, auto = on CUDA): queue each decode
    step before reading the previous one's tokens (:meth:`_decode`). ``kv_cache_dtype``: the
    pool's storage, bf16 (the model's dtype) | fp8 (e4m3 + scales, ``pool_cache``)."""

    def __init__(self, model, kv_budget_tokens: int, *, max_rows: int = 64,
                 max_row_tokens: int | None = None, prefix_cache_tokens: int = 0,
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS, pipeline: bool | None = None,
                 decode_extension_tokens: int = DEFAULT_DECODE_EXTENSION_TOKENS,
                 kv_cache_dtype: str = "bf16"):
        if model.head_kind != "causal_lm":
            raise TypeError(f"{type(model).__name__} has no LM head; generation needs a CausalLM")
        self.parallel_layout = check_generation_layout(model)  # the model's (its TP group)
        self.model = model
        self.device = model.device
        self.max_prefill_tokens = max_prefill_tokens
        self.decode_extension_tokens = max(0, int(decode_extension_tokens))
        positions = int(getattr(model.config, "max_position_embeddings", 0) or kv_budget_tokens)
        self.max_row_tokens = int(max_row_tokens or min(kv_budget_tokens, positions))
        self.scheduler = Scheduler(kv_budget_tokens, max_rows, self.max_row_tokens)
        # decode entries a step may hold: the rows, plus room for one fed re-entry's others
        self.max_entries = max_rows + max(0, self.decode_extension_tokens - 1)
        attn = model.model.layers[0].self_attn.qkv_proj
        self.cache = PoolKVCache(len(model.model.layers), kv_budget_tokens, self.max_entries,
                                 self.max_row_tokens, attn.num_kv_heads_per_rank, attn.head_dim,
                                 model.dtype, self.device, kv_cache_dtype)
        self.prefixes = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        self.buckets = bucket_sizes(max_rows)
        if self.max_entries > max_rows:  # a bucket for the steps that feed re-entries beside
            self.buckets.append(self.max_entries)  # (nearly) every row
        use_graph = (self.device.type == "cuda" and self.cache.graph_safe
                     and not model.config.rope_depends_on_length and option("cuda_graphs"))
        self._steps = {b: BucketStep(model, self.cache, DecodeRows(b, self.device, self.cache.end),
                                      use_graph) for b in self.buckets}
        if pipeline is None:  # the option: "auto" = on CUDA; true: everywhere; false: off
            setting = option("decode_pipeline")
            pipeline = setting is True or (setting == "auto" and self.device.type == "cuda")
        self.pipeline = pipeline
        self._pending: _Drawn | None = None  # a decode step queued, its tokens not yet read
        self.running: list[_Row] = []
        self._layout: DecodeLayout | None = None  # None: rebuild the decode buffers next step
        self._last_tokens: torch.Tensor | None = None
        self.steps = 0
        self.prefilled_prompts = 0  # prompts run through the model (prefix hits excluded)
        self.prefill_calls = 0      # model calls of prefill (packs)
        self.prefilled_tokens = 0   # tokens they ran (an extension: its new tokens only)
        self.decode_steps = 0       # decode steps launched
        self.decode_rows = 0        # the running rows of those steps, summed
        self.decode_fed_tokens = 0  # re-entries' new tokens run in decode steps (not prefilled)
        self.fed_waiting_steps = 0  # decode steps a fed re-entry waited out (no room)
        self.generated_tokens = 0
        # host wall seconds in step()'s prefills and decode steps (each waits for the device's
        # tokens of its own or the previous step: together, the engine's busy time)
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.on_tokens: Callable[[int], None] | None = None  # (tokens drawn), before callbacks

    # ---- requests -------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: SamplingParams, *, stop_ids=(),
               top_logprobs: int = 0, generator: torch.Generator | None = None,
               on_token=None, on_done=None, stop_sequences=None, keep_kv: bool = False,
               resume: KeptKV | None = None) -> Request:
        """Queue ``params.n`` samples of ``prompt``; raises ``KVBudgetError`` if they can never
        fit, ``ValueError`` on a bad prompt or params. Runs on the next :meth:`step`.
        ``stop_sequences``: token-id sequences that also end a sample (kept in it).
        ``keep_kv`` (n=1): keep the region when the sample finishes (``request.kept``);
        ``resume``: such a kept region, whose tokens ``prompt`` extends (only the rest is
        prefilled; an evicted one: the whole prompt)."""
        params.validate()
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("empty prompt")
        if top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {top_logprobs}")
        seed = params.seed
        if seed is None:  # (greedy draws no noise: the global generator is left alone)
            seed = 0 if params.greedy else int(torch.randint(0, 1 << 62, (1,),
                                                             generator=generator))
        if keep_kv and params.n != 1:
            raise ValueError(f"keep_kv needs n=1, got n={params.n}")
        if resume is not None and (len(prompt) <= resume.length
                                   or tuple(prompt[:resume.length]) != resume.tokens):
            raise ValueError("resume: the prompt does not extend the kept region's tokens")
        req = Request(prompt, params, frozenset(stop_ids), top_logprobs, int(seed), on_token,
                      on_done, check_stop_sequences(stop_sequences), keep_kv=keep_kv,
                      resume=resume)
        self.scheduler.add(req)  # KVBudgetError before anything is queued
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.scheduler.waiting)

    def clear_prefixes(self) -> None:
        """Forget every cached prompt KV and kept region (call after a weight change)."""
        if self.prefixes is not None:
            self.prefixes.clear()
        self.scheduler.drop_kept()

    def release_kept(self, kept: KeptKV | None) -> None:
        """Give back a region kept by a ``keep_kv`` request (None or no longer kept: no-op)."""
        if kept is not None:
            self.scheduler.release_kept(kept)

    def feeds(self, new_tokens: int) -> bool:
        """Whether a resume with ``new_tokens`` past its kept KV runs them in a decode step."""
        return self.extends and new_tokens <= self.decode_extension_tokens

    @property
    def extends(self) -> bool:
        """Whether a resumed request prefills only its new tokens (else its whole prompt)."""
        return not exact.enabled() and not self.model.config.rope_depends_on_length

    @torch.no_grad()
    def step(self) -> None:
        """Admit and prefill what fits, then one decode step of every running row."""
        with sequence_parallel_off(self.model):
            admitted = self.scheduler.admit()
            if admitted:
                start = time.perf_counter()
                self._prefill(admitted)
                self.prefill_seconds += time.perf_counter() - start
            if self.running:
                start = time.perf_counter()
                self._decode()
                self.decode_seconds += time.perf_counter() - start
        self.steps += 1

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Step until nothing is left (or ``until()`` is true)."""
        while self.has_work and not (until is not None and until()):
            self.step()

    # ---- model work ---------------------------------------------------------------------
    def _prefill(self, admitted) -> None:
        device, cache = self.device, self.cache
        logits_of: dict[int, torch.Tensor] = {}
        misses, first_of, copy_of, extending, fed = [], {}, {}, [], []
        for i, (req, starts) in enumerate(admitted):
            if req.extend_from and self.extends:
                if req.moved_from is not None:  # the kept KV, into the larger region
                    cache.copy(req.moved_from, starts, req.extend_from)
                new = len(req.prompt) - req.extend_from
                # a decode step runs its new tokens: the next one with room (decode_layout)
                if self.feeds(new):
                    fed.append(i)
                    self.decode_fed_tokens += new
                else:
                    extending.append(i)
                continue
            key = tuple(req.prompt)
            if key in first_of:  # the same prompt admitted twice now: one prefill serves both
                copy_of[i] = first_of[key]
                continue
            first_of[key] = i
            hit = self.prefixes.get(req.prompt) if self.prefixes is not None else None
            if hit is None:
                misses.append(i)
            else:
                cache.write(starts[0], hit[0], hit[1])
                logits_of[i] = hit[2]
        for chunk in self._prefill_chunks(misses, admitted):
            prompts = [admitted[i][0].prompt for i in chunk]
            lengths = torch.tensor([len(p) for p in prompts], device=device)
            cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
            ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
            positions = torch.cat([torch.arange(len(p), device=device) for p in prompts])
            offsets = torch.tensor([admitted[i][1][0] for i in chunk], device=device)
            cache.begin_prefill(offsets, cu)
            hidden, _ = self.model.forward_hidden(ids, cu, positions, max(map(len, prompts)),
                                                  kv_cache=cache)
            cache.end_step()
            last = self.model._head(hidden[(cu[1:] - 1).long()], 0, full_vocab=True)
            for j, i in enumerate(chunk):
                logits_of[i] = last[j]
            self.prefilled_prompts += len(chunk)
            self.prefill_calls += 1
            self.prefilled_tokens += int(ids.numel())
        if extending:
            logits = prefill_extensions(self, [(admitted[i][0].prompt, admitted[i][1][0],
                                                admitted[i][0].extend_from) for i in extending])
            logits_of.update(zip(extending, logits))
            self.prefilled_prompts += len(extending)
        rows, row_logits = [], []
        for i in fed:  # no logits yet: their first token comes from the next decode step
            req, starts = admitted[i]
            req.samples, req.rows_left = [Sample(top_logprobs=[] if req.top_logprobs else None)], 1
            self.running.append(_Row(req, 0, starts[0], req.extend_from, row_seed(req.seed, 0),
                                     feed=req.prompt[req.extend_from:]))
            self.prefilled_prompts += 1
            self._layout = None
        for i, (req, starts) in enumerate(admitted):
            if i in fed:
                continue
            p = len(req.prompt)
            if i in copy_of:
                source = copy_of[i]
                cache.copy(admitted[source][1][0], starts, p)
                logits_of[i] = logits_of[source]
            else:
                cache.copy(starts[0], starts[1:], p)  # the n samples share one prefill
            if self.prefixes is not None and i in misses:
                k, v = cache.read(starts[0], p)
                self.prefixes.put(req.prompt, k, v, logits_of[i].clone())
            req.samples = [Sample(top_logprobs=[] if req.top_logprobs else None)
                           for _ in range(req.n)]
            req.rows_left = req.n
            for j, start in enumerate(starts):
                rows.append(_Row(req, j, start, p, row_seed(req.seed, j)))
                row_logits.append(logits_of[i])
        if rows:
            self._draw_and_accept(rows, torch.stack(row_logits), newly_admitted=True)

    def _prefill_chunks(self, misses: list[int], admitted) -> list[list[int]]:
        """``misses`` in packs of at most ``max_prefill_tokens`` prompt tokens (one prompt over
        it runs alone): the prefill's activations stay bounded however many prompts start."""
        chunks, tokens = [], 0
        for i in misses:
            n = len(admitted[i][0].prompt)
            if not chunks or tokens + n > self.max_prefill_tokens:
                chunks.append([])
                tokens = 0
            chunks[-1].append(i)
            tokens += n
        return chunks

    def _decode(self) -> None:
        """One decode step of every running row. While no row joins or leaves, the bucket's
        buffers are advanced on the device (last tokens in, lengths + 1): no host rebuild.

        With ``pipeline`` the step's tokens are read by the NEXT call, after it has queued the
        following step on the device (its input tokens never leave the device): the GPU decodes
        while the host handles the previous tokens. A row that finished meanwhile drops the
        token drawn for it ahead (its KV write stays inside its own region, and anything later
        placed there is written after it in stream order). Outputs are those of the plain path.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            if pending.layout is self._layout:  # no row joined, left or was fed since
                if any(r.generated + 1 < r.request.params.max_new_tokens
                       for r in self._layout.rows):  # (not when every row ends with `pending`)
                    self._pending = self._launch(self._layout)
                self._accept(pending)
                return
            self._accept(pending)
            if not self.running:
                return
        drawn = self._launch(self._layout)
        if self.pipeline:
            self._pending = drawn
        else:
            self._accept(drawn)

    def _launch(self, lay: DecodeLayout | None) -> _Drawn:
        """Queue one decode step of the running rows (``lay``, or a new layout when None) and
        its draw; nothing waits for the device."""
        if lay is None:
            lay, host, span = build_layout(self.running, self.buckets, self.cache.scratch,
                                           self.device)
            if not lay.rows:  # (only fed rows waiting for room: cannot happen, one always fits)
                raise RuntimeError("decode step with no row")
            self.fed_waiting_steps += lay.waiting
            self._steps[lay.size].rows.load(host.to(self.device, non_blocking=True), span=span)
            # a layout with fed rows serves this step only: the next one is built again
            self._layout = None if lay.transient else lay
        else:
            buffers, n = self._steps[lay.size].rows, len(lay.rows)
            buffers.tokens[:n].copy_(self._last_tokens)
            buffers.lengths[:n] += 1
            buffers.span += 1
            if lay.steps is not None:
                lay.steps += 1
        logits = self._steps[lay.size]()
        for r in lay.rows:
            r.length += 1
        self.decode_steps += 1
        self.decode_rows += len(lay.rows)
        logits = logits[:len(lay.rows)] if lay.take is None else logits[lay.take]
        return self._draw(lay.rows, logits, lay)

    def _draw_and_accept(self, rows: list[_Row], logits: torch.Tensor, lay=None,
                         newly_admitted: bool = False) -> None:
        if lay is None:
            lay = DecodeLayout(rows, 0, *sampling_of(rows, self.device))
        self._accept(self._draw(rows, logits, lay), newly_admitted)

    def _draw(self, rows: list[_Row], logits: torch.Tensor, lay: DecodeLayout) -> _Drawn:
        """Queue the draw of ``rows``' next tokens and their copy to the host."""
        tokens, logp, top = draw(logits, lay.seeds, lay.steps, lay.spec, lay.k_max)
        tokens, logp = _broadcast_in_tp_group(self.parallel_layout, tokens, logp)
        if top is not None:
            top = _broadcast_in_tp_group(self.parallel_layout, *top)
        self._last_tokens = tokens
        both = torch.stack([tokens.double(), logp.double()])
        ready = None
        if both.is_cuda:
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = both
        return _Drawn(rows, lay if lay.size else None, host, ready, top)

    def _accept(self, drawn: _Drawn, newly_admitted: bool = False) -> None:
        """Hand ``drawn``'s tokens to their samples (rows finished meanwhile skip theirs); finish
        the rows that stop or reach their length."""
        if drawn.ready is not None:
            drawn.ready.synchronize()  # the step's one wait on the device
        tokens, logp = drawn.host[0].long().tolist(), drawn.host[1].tolist()
        top = drawn.top
        if top is not None:
            top = (top[0].tolist(), top[1].tolist())
        rows = drawn.rows
        if newly_admitted:
            self.running.extend(rows)
            self._layout = None
        else:  # rows that finished after this step was queued drop its token
            live = [i for i, r in enumerate(rows)
                    if r.request.samples[r.index].finish_reason is None]
            if len(live) < len(rows):
                tokens, logp = [tokens[i] for i in live], [logp[i] for i in live]
                if top is not None:
                    top = ([top[0][i] for i in live], [top[1][i] for i in live])
                rows = [rows[i] for i in live]
        self.generated_tokens += len(rows)
        if self.on_tokens is not None:
            self.on_tokens(len(rows))
        finished = []
        for i, r in enumerate(rows):
            req, sample = r.request, r.request.samples[r.index]
            tok = tokens[i]
            sample.token_ids.append(tok)
            sample.log_probs.append(logp[i])
            pairs = None
            if req.top_logprobs:
                pairs = [[a, b] for a, b in zip(top[0][i][:req.top_logprobs],
                                                top[1][i][:req.top_logprobs])]
                sample.top_logprobs.append(pairs)
            r.token, r.generated = tok, r.generated + 1
            if req.on_token is not None:
                req.on_token(r.index, tok, logp[i], pairs)
            if tok in req.stop_ids or (req.stop_sequences and ends_with_stop_sequence(
                    sample.token_ids, req.stop_sequences)):
                sample.finish_reason = "stop"
            elif r.generated >= req.params.max_new_tokens:
                sample.finish_reason = "length"
            else:
                continue
            finished.append(r)
        if finished:
            self._layout = None
            gone = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in gone]
            for r in finished:
                if r.request.keep_kv:  # KV of the prompt and every drawn token but the last
                    tokens = r.request.prompt + r.request.samples[0].token_ids[:-1]
                    r.request.kept = self.scheduler.keep(r.offset, r.request.row_tokens, tokens)
                else:
                    self.scheduler.release(r.offset, r.request.row_tokens)
                r.request.rows_left -= 1
                if r.request.rows_left == 0 and r.request.on_done is not None:
                    r.request.on_done(r.request)
        if not self.running:
            self._pending = None  # a step queued ahead for rows that all finished: nothing to read


__all__ = ["ContinuousEngine", "KVBudgetError", "Request", "Sample", "generation_output",
           "request_seed"]
