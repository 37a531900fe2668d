"""Rollout generation on the parallel CausalLM: KV-cached incremental decoding at any TP.

Prompts of different lengths are packed for the prefill and each keeps its own cache row, so no
compute is spent on padding. Every TP rank runs the model on its heads; the next-token logits
are gathered over the vocab and the tokens drawn on TP rank 0 are broadcast, so all ranks of a
TP group continue with the same tokens. The TP group is that of the model's own
``ParallelLayout`` (``model.parallel_layout``: the training layout, or the rollout engine's TP'
layout). Pipeline parallel is not supported here (clear error): build the rollout model with
PP=1, or serve it with the rollout server.

On CUDA the decode step (all layers and the LM head, fixed batch) is captured once per call in
a CUDA graph and replayed: a step is then a single launch instead of hundreds of small kernels
(decode of a small batch is launch-bound). Sampling stays outside the graph; whether any
sequence is still running is read one step late (no host sync per step), and the extra step is
cut. The option ``cuda_graphs`` off (``PARALLEL_MODELS_CUDA_GRAPHS=0``) turns graphs off.

Returned ``log_probs`` are ``log_softmax(logits / temperature)`` of the chosen tokens (top-k /
top-p only restrict what can be drawn), which is what a fresh forward pass of the same tokens
gives and what PPO's importance ratio needs. With ``top_logprobs=k`` (only then; the OpenAI-style
``logprobs`` of the server) each step also returns the k most likely tokens of that same
distribution and their log-probs (``top_token_ids`` / ``top_log_probs``). ``on_step`` (the
server's streaming) is called with each step's tokens as they are drawn; it reads them on the
host, so on CUDA a step with it waits for its tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from parallel_models.llama.layers import exact
from parallel_models.inference.kv_cache import KVCache
from parallel_models.inference.route_collector import RouteCollector
from parallel_models.inference.row_sampling import draw, filter_logits
from parallel_models.inference.sampling import SamplingParams
from parallel_models.inference.stop_sequences import StopSequenceWindow
from parallel_models.options import option


@dataclasses.dataclass
class GenerationOutput:
    prompts: torch.Tensor          # [B, P] left-padded prompt ids
    prompt_mask: torch.Tensor      # [B, P]
    responses: torch.Tensor        # [B, R] right-padded response ids (stop token included)
    response_mask: torch.Tensor    # [B, R]
    log_probs: torch.Tensor        # [B, R] float32, 0 where masked
    top_token_ids: torch.Tensor | None = None   # [B, R, k] with top_logprobs=k, else None
    top_log_probs: torch.Tensor | None = None   # [B, R, k] float32, their log-probs
    routes: torch.Tensor | None = None  # [B, P+R, moe_layers, k] experts used (record_routes)

    @property
    def sequences(self) -> torch.Tensor:
        return torch.cat([self.prompts, self.responses], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)


@contextlib.contextmanager
def sequence_parallel_off(model):
    """Decode steps carry one token per sequence: run them without sequence parallel (the
    weights are the same; only the communication pattern changes)."""
    if not model.sequence_parallel:
        yield
        return
    touched = []
    for m in model.modules():
        for attr in ("sequence_parallel", "reduce_scatter_embeddings"):
            if getattr(m, attr, None) is True:
                touched.append((m, attr))
                setattr(m, attr, False)
    try:
        yield
    finally:
        for m, attr in touched:
            setattr(m, attr, True)


def _next_tokens(logits: torch.Tensor, params: SamplingParams, generator=None, top_logprobs=0):
    """Draw the next tokens; -> (tokens, their log-probs, (top ids, top log-probs) or None)."""
    raw, logits = logits, logits.float()  # raw: exact mode's log-prob reads the model's dtype
    if params.greedy:
        tokens = logits.argmax(-1)
        scaled = logits
    else:
        scaled = logits / params.temperature
        filtered = filter_logits(scaled, params.top_k, params.top_p)
        tokens = torch.multinomial(torch.softmax(filtered, -1), 1, generator=generator).squeeze(-1)
    all_log_probs = torch.log_softmax(scaled, -1)
    log_probs = all_log_probs.gather(-1, tokens[:, None]).squeeze(-1)
    if exact.enabled():  # the training loss's log-prob kernel (layers/exact)
        from parallel_models.llama.layers.exact import ops

        log_probs = ops.token_log_probs(raw, tokens, 1.0 if params.greedy
                                        else params.temperature)
    top = None
    if top_logprobs:
        values, ids = torch.topk(all_log_probs, min(top_logprobs, all_log_probs.shape[-1]), -1)
        top = (ids, values)
    return tokens, log_probs, top


def _broadcast_in_tp_group(layout, *tensors):
    """``tensors`` from TP rank 0 of ``layout``'s TP group to the others (in place)."""
    if layout.tensor_parallel_size == 1:
        return tensors
    src = layout.tensor_parallel_src_rank
    for t in tensors:
        dist.broadcast(t, src=src, group=layout.tp_group)
    return tensors


def check_generation_layout(model):
    """``model``'s layout, after checking the decoding engines can run it (PP = 1)."""
    layout = model.parallel_layout
    if layout.pipeline_parallel_size > 1:
        raise NotImplementedError("generation with pipeline_parallel_size > 1 is not supported; "
                                  "build the rollout model with PP=1 (TP only)")
    return layout


def _last_token_logits(model, hidden, last_index):
    return model._head(hidden[last_index], 0, full_vocab=True)


_warmup_streams: dict = {}  # device index -> the side stream of every capture's warm-up


def capture_cuda_graph(forward):
    """``forward()`` run once eagerly on a side stream (compiles kernels, initializes libraries),
    then captured as a CUDA graph; returns ``(graph, output)`` where replaying the graph rewrites
    ``output`` in place. The side stream is one per device for every capture: with a new one per
    capture (``torch.cuda.Stream()`` hands out the pool's 32 streams in turn, and each continuous
    engine captures its buckets again), cuBLAS gets a workspace for each stream it meets and
    keeps it for the process. Where the eager run tuned FP8 decode GEMMs, their runners-up are
    compared in the captured step too (``fp8.graph_tuning``)."""

    def capture():
        device = torch.cuda.current_device()
        side = _warmup_streams.get(device)
        if side is None:
            side = _warmup_streams[device] = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = forward()
        return graph, output

    from parallel_models.inference.fp8 import decode_tuning

    decode_tuning.used.clear()  # (the keys this step asks for: graph_tuning compares those)
    graph, output = capture()
    if not decode_tuning.fresh:
        return graph, output
    from parallel_models.inference.fp8 import graph_tuning

    return graph_tuning.refine(capture, graph, output)


class _DecodeStep:
    """One decode step of every row: tokens ``[B]`` in a fixed buffer -> logits ``[B, vocab]``.

    Replayed from a CUDA graph when possible; the first call runs eagerly on a side stream (it
    compiles kernels and initializes libraries; the cache entry it writes is the one the replay
    rewrites with the same values), then captures.
    """

    def __init__(self, model, cache, batch: int, device):
        self.model, self.cache = model, cache
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.graph = None
        self.use_graph = (device.type == "cuda" and not model.config.rope_depends_on_length
                          and option("cuda_graphs"))

    def _forward(self):
        self.cache.begin_decode()
        hidden, _ = self.model.forward_hidden(self.tokens, self.cu, self.cache.lengths, 1,
                                              kv_cache=self.cache)
        return self.model._head(hidden, 0, full_vocab=True)

    def __call__(self, tokens):
        self.tokens.copy_(tokens)
        if not self.use_graph:
            return self._forward()
        if self.graph is None:
            try:
                self._capture()
            except Exception as err:  # e.g. an op that syncs: run eagerly from now on
                warnings.warn(f"CUDA graph capture of the decode step failed ({err}); decoding "
                              "eagerly")
                self.use_graph, self.graph = False, None
                return self._forward()
        if self.cache.filled >= self.cache.max_length:
            raise ValueError(f"KV cache of {self.cache.max_length} positions is full")
        self.graph.replay()
        return self.logits

    def _capture(self):
        self.graph, self.logits = capture_cuda_graph(self._forward)


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], params: SamplingParams,
             generator: torch.Generator | None = None, *,
             stop_token_ids: Sequence[int] | None = None,
             pad_token_id: int = 0, top_logprobs: int = 0,
             on_step: Callable | None = None, record_routes: bool = False,
             row_limits: Sequence[int] | None = None,
             row_seeds: Sequence[int] | None = None,
             stop_sequences: Sequence[Sequence[int]] | None = None) -> GenerationOutput:
    """Sample one continuation of each of ``prompts`` (token-id lists) with ``model`` (a
    parallel CausalLM); ``params.n`` must be 1 here (``RolloutEngine.generate`` repeats rows).

    Every rank of a TP group must pass the same prompts. ``generator`` (else a generator seeded
    with ``params.seed``, else the global one) drives sampling; TP rank 0's draws are used by the
    whole group. ``stop_token_ids`` (default ``params.stop_ids()``: EOS then the extra stop ids)
    end a sample; ``pad_token_id`` fills the prompt and response padding. ``top_logprobs=k > 0``
    also returns, per generated token, the k most likely tokens and their log-probs.
    ``on_step(tokens, log_probs, produced, top)`` is called after each step (``[B]`` tensors;
    ``produced``: the rows that made a token this step; ``top``: (ids, log-probs) ``[B, k]`` or
    None); pass it on one rank only. ``record_routes`` (MoE models) also returns the top-k
    experts of every prompt and generated token per MoE layer (``rollout/route_collector.py``).
    ``row_limits``: a cap on each row's new tokens (<= ``params.max_new_tokens``).
    ``row_seeds``: one seed per row; each row then draws with its own counter-based noise
    (``row_sampling.draw``, the continuous batcher's draws), so its tokens depend on its seed and
    logits only, not on the batch, the rank or ``generator``.
    ``stop_sequences``: token-id sequences that end a row once it generated one of them (its
    tokens kept; ``stop_sequences.StopSequenceWindow``).
    """
    params.validate()
    if params.n != 1:
        raise ValueError(f"generate draws one sample per row, got n={params.n}; repeat the rows "
                         "or use RolloutEngine.generate")
    if model.head_kind != "causal_lm":
        raise TypeError(f"{type(model).__name__} has no LM head; generation needs a CausalLM")
    layout = check_generation_layout(model)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and no empty prompt")
    device = model.device
    batch = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths.tolist()])
    attn = model.model.layers[0].self_attn.qkv_proj
    cache = KVCache(len(model.model.layers), batch, int(lengths.max()) + params.max_new_tokens,
                    attn.num_kv_heads_per_rank, attn.head_dim, model.dtype, device)
    if stop_token_ids is None:
        stop_token_ids = params.stop_ids()
    stop = torch.tensor(list(stop_token_ids) or [-1], device=device)
    window = StopSequenceWindow(stop_sequences, batch, device) if stop_sequences else None
    if generator is None and params.seed is not None and not params.greedy:
        generator = torch.Generator(device=device).manual_seed(int(params.seed))
    seeds = None
    if row_seeds is not None:
        if len(row_seeds) != batch:
            raise ValueError(f"row_seeds: {len(row_seeds)} seeds for {batch} rows")
        seeds = torch.tensor([int(s) for s in row_seeds], dtype=torch.long, device=device)

    if top_logprobs < 0:
        raise ValueError(f"top_logprobs must be >= 0, got {top_logprobs}")
    tokens_out, logp_out, alive_out, top_out = [], [], [], []
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    limits = None if row_limits is None else torch.tensor(list(row_limits), device=device)
    # on CUDA "any sequence still running?" is copied without blocking and read a step later
    lagged = device.type == "cuda"
    any_alive = torch.ones((), dtype=torch.bool, pin_memory=lagged)
    any_alive_ready = None
    routes = RouteCollector(model) if record_routes else None
    with sequence_parallel_off(model):
        cache.begin_prefill(cu)
        hidden, _ = model.forward_hidden(ids, cu, positions, int(lengths.max()), kv_cache=cache)
        cache.end_step()
        if routes is not None:
            routes.prefill()
        logits = _last_token_logits(model, hidden, (cu[1:] - 1).long())
        decode_step = _DecodeStep(model, cache, batch, device)
        for step in range(params.max_new_tokens):
            if seeds is None:
                tokens, logp, top = _next_tokens(logits, params, generator, top_logprobs)
            else:  # per-row noise of (row seed, step, vocab id)
                tokens, logp, top = draw(logits, seeds, torch.full_like(seeds, step),
                                         [(None, params)], top_logprobs)
            tokens, logp = _broadcast_in_tp_group(layout, tokens, logp)
            if top is not None:
                top_out.append(_broadcast_in_tp_group(layout, *top))
            tokens = torch.where(alive, tokens, torch.full_like(tokens, pad_token_id))
            tokens_out.append(tokens)
            logp_out.append(torch.where(alive, logp, torch.zeros_like(logp)))
            alive_out.append(alive.clone())
            if on_step is not None:
                on_step(tokens, logp, alive_out[-1], top)
            alive = alive & ~torch.isin(tokens, stop)
            if window is not None:
                alive = alive & ~window.push(tokens)
            if limits is not None:
                alive = alive & (limits > step + 1)
            if step == params.max_new_tokens - 1:
                break
            if not lagged:
                if not bool(alive.any()):
                    break
            else:
                if any_alive_ready is not None:  # the previous step's flag: the GPU keeps busy
                    any_alive_ready.synchronize()
                    if not bool(any_alive):
                        break
                any_alive.copy_(alive.any(), non_blocking=True)
                any_alive_ready = torch.cuda.Event()
                any_alive_ready.record()
            logits = decode_step(tokens)
            cache.end_step()
            if routes is not None:
                routes.step()
        del decode_step  # frees the graph's memory pool
    # a step made after every sequence had stopped (the flag is read one step late) is cut
    while len(alive_out) > 1 and not bool(alive_out[-1].any()):
        tokens_out.pop(), logp_out.pop(), alive_out.pop()
        if top_out:
            top_out.pop()

    p_max = int(lengths.max())
    prompt_ids = torch.full((batch, p_max), pad_token_id, dtype=torch.long, device=device)
    prompt_mask = torch.zeros((batch, p_max), dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        prompt_ids[b, p_max - len(p):] = torch.as_tensor(list(p), device=device)
        prompt_mask[b, p_max - len(p):] = 1
    top_ids = top_logps = None
    if top_out:
        top_ids = torch.stack([ids for ids, _ in top_out], 1)
        top_logps = torch.stack([vals for _, vals in top_out], 1)
    response_mask = torch.stack(alive_out, 1).long()
    return GenerationOutput(prompts=prompt_ids, prompt_mask=prompt_mask,
                            responses=torch.stack(tokens_out, 1), response_mask=response_mask,
                            log_probs=torch.stack(logp_out, 1),
                            top_token_ids=top_ids, top_log_probs=top_logps,
                            routes=None if routes is None else
                            routes.assemble(lengths.tolist(), response_mask))


__all__ = ["GenerationOutput", "SamplingParams", "generate", "sequence_parallel_off"]
