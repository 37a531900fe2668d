"""Activation recomputation of the parallel models (``actor.recompute`` and the critic's and
reference's): trade compute in the backward for activation memory, as megatron-core's
``TransformerConfig.recompute_granularity`` does.

- ``none``: every activation is kept for the backward (the default).
- ``selective``: megatron-core's selective granularity: the core attention (the varlen causal
  kernel on q, k, v; under context parallelism the K/V all-gather and the attention of this
  rank's chunks) is recomputed in the backward instead of keeping what it saved.
- ``full``: megatron-core's full granularity with ``recompute_method=uniform`` and
  ``recompute_num_layers=1``: only each decoder layer's input is kept; the layer is run again in
  the backward.

Recomputation goes through ``torch.utils.checkpoint`` (non-reentrant, so parameter gradients
flow whether or not the layer input requires grad, e.g. a frozen embedding) with the CPU and
CUDA generators restored for the recompute (``preserve_rng_state``) and megatron-core's
model-parallel RNG tracker too (:func:`_tracker_contexts`: dropout inside a TP region draws the
same mask again). It only acts when autograd records (a no-grad forward, e.g. scoring or
generation, runs as without it). :func:`set_recompute` sets the mode on a model's decoder and
attention modules and on its megatron-core ``TransformerConfig`` (what megatron's own code
reads).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils.checkpoint import checkpoint

from parallel_models.errors import ConfigError
from parallel_models.llama.layers.attention_kernels import varlen_causal_attention
from parallel_models.llama.layers.context_parallel import context_parallel_attention

RECOMPUTE_MODES = ("none", "selective", "full")


def _tracker_contexts():
    """(forward context, recompute context) for ``torch.utils.checkpoint``'s ``context_fn``: the
    recompute runs with megatron-core's model-parallel RNG tracker states as they were in the
    forward, and puts the current ones back afterwards."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    saved = tracker.get_states()  # the tracker replaces its states after use: these stay valid

    @contextlib.contextmanager
    def recompute():
        current = tracker.get_states()
        tracker.set_states(saved)
        try:
            yield
        finally:
            tracker.set_states(current)

    return contextlib.nullcontext(), recompute()


def recomputed(fn, *args):
    """``fn(*args)`` keeping only its inputs for the backward, which runs it again."""
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=_tracker_contexts)


def core_attention(q, k, v, cu_seqlens, max_seqlen, *, scale):
    """The varlen causal attention, recomputed in the backward (selective recomputation)."""
    if not torch.is_grad_enabled():
        return varlen_causal_attention(q, k, v, cu_seqlens, max_seqlen, scale=scale)
    fn = functools.partial(varlen_causal_attention, max_seqlen=max_seqlen, scale=scale)
    return recomputed(fn, q, k, v, cu_seqlens)


def context_parallel_core_attention(q, k, v, shard, *, scale):
    """The context-parallel attention (the all-gather of K and V over the CP ranks and the
    causal attention of this rank's chunks), recomputed in the backward (selective): only the
    local q, k, v are kept, as megatron-core's selective recompute of a CP core attention keeps
    them; the recompute gathers again (every CP rank recomputes the same layers in the same
    order, so the collectives pair up)."""
    if not torch.is_grad_enabled():
        return context_parallel_attention(q, k, v, shard, scale)
    fn = functools.partial(context_parallel_attention, shard=shard, scale=scale)
    return recomputed(fn, q, k, v)


def decoder_layer(layer, hidden, cos, sin, cu_seqlens, max_seqlen):
    """One decoder layer whose activations are recomputed in the backward (full)."""
    fn = functools.partial(layer, max_seqlen=max_seqlen)
    return recomputed(fn, hidden, cos, sin, cu_seqlens)


def set_recompute(model, mode: str) -> None:
    """Set the recomputation ``mode`` (none | selective | full) of ``model`` (a parallel model,
    or a list of its pipeline chunks): its decoder runs each layer through
    :func:`decoder_layer` (full), its attention modules through :func:`core_attention`
    (selective); megatron-core's ``TransformerConfig`` of each chunk says the same."""
    if mode not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute must be one of {' | '.join(RECOMPUTE_MODES)}, got "
                          f"{mode!r}")
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        if mode == "full" and chunk.config.is_moe:
            raise ConfigError("recompute=full is not supported for MoE models (their router "
                              "records and replays routes in the forward); use selective")
        chunk.model.recompute = mode
        for layer in chunk.model.layers:
            layer.self_attn.recompute_core_attention = mode == "selective"
        mp_config = getattr(chunk, "mp_config", None)
        if mp_config is not None:
            mp_config.recompute_granularity = None if mode == "none" else mode
            mp_config.recompute_method = "uniform" if mode == "full" else None
            mp_config.recompute_num_layers = 1 if mode == "full" else None


__all__ = ["RECOMPUTE_MODES", "context_parallel_core_attention", "core_attention",
           "decoder_layer", "recomputed", "set_recompute"]
