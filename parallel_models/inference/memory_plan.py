"""Rollout memory planning: how many KV positions and how large a prefill chunk fit on a device.

``gpu_memory_utilization`` has vLLM's meaning: the share of the device's memory the rollout
engine may use for its weights, its KV pool and its activations. Everything already resident on
the device when the engine is made (the rollout weights, training state that was not offloaded,
the CUDA context, other processes) counts against that share; memory PyTorch's caching allocator
holds but does not use counts as free. What is left is split between

- the sampling and decode activations: per decode row the full-vocab logits and the sampler's
  fp32 temporaries (``SAMPLING_FLOATS_PER_VOCAB`` floats per vocab entry), plus the decode
  step's layer activations (``decode_rows`` x the per-token activation bytes, once per captured
  bucket size: at most twice the largest bucket);
- the prefill chunk's activations (:func:`activation_bytes_per_token`, from the model shape: the
  residual stream, the fused gate/up projection and SwiGLU's intermediate temporaries, or the
  attention's q/k/v, rotary copies and output, whichever is larger); the chunk is
  ``max_prefill_tokens`` unless its activations would take more than ``PREFILL_SHARE`` of the
  memory left, never below the longest prompt (a prompt over the chunk is prefilled alone);
- the KV pool, which gets the rest (``kv_bytes_per_token`` each: K and V of every layer for this
  rank's KV heads; an fp8 pool, ``kv_cache_dtype="fp8"``: 1 byte per element plus an fp32 scale
  per head, about half), capped at what the requests can use at once (rows x longest row).

An explicit ``kv_budget_tokens`` overrides the KV share; the prefill chunk is then sized from what
remains. A plan that cannot hold one row of the longest request (prompt + ``max_new_tokens``
positions) and that prompt's prefill raises :class:`MemoryPlanError` before anything is
generated, with the numbers. Pure arithmetic: :func:`device_memory` reads the device, everything
else takes numbers, so the plan is unit-tested on the CPU.
"""

from __future__ import annotations

import dataclasses

from parallel_models.inference.scheduler import KVBudgetError

GIB = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
PREFILL_SHARE = 0.5  # the prefill chunk's activations take at most this share of what is left
# fp32 floats per (decode row, vocab entry) while sampling: the logits in fp32, the log-softmax,
# the probabilities / noise and a top-k/top-p sort (values + int64 indices = 3 floats)
SAMPLING_FLOATS_PER_VOCAB = 6


class MemoryPlanError(KVBudgetError):
    """The rollout does not fit the device at this ``gpu_memory_utilization``: the message names
    the weights, the memory the engine may use, the KV bytes per token and the minimum tokens."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model, per rank: ``kv_heads`` and ``heads`` are this TP rank's,
    ``intermediate`` this rank's MLP width (MoE: top-k x the expert width, if larger);
    ``kv_fp8``: the KV pool in e4m3 with fp32 scales per (position, head) (``pool_cache``)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int
    kv_fp8: bool = False

    @classmethod
    def of(cls, model, kv_cache_dtype: str = "bf16") -> "ModelShape":
        """The shape of a parallel CausalLM (this rank's share of the heads and the MLP) with
        its KV pool in ``kv_cache_dtype`` (bf16: the model's dtype | fp8)."""
        cfg = model.config
        attn = model.model.layers[0].self_attn.qkv_proj
        tp = model.parallel_layout.tensor_parallel_size
        inter = int(getattr(cfg, "intermediate_size", 0) or 0)
        top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        expert = int(getattr(cfg, "moe_intermediate_size", 0) or 0)
        inter = max(inter, top_k * expert)
        heads = int(cfg.num_attention_heads) // tp
        return cls(layers=len(model.model.layers), hidden=int(cfg.hidden_size),
                   intermediate=-(-inter // tp), heads=heads,
                   kv_heads=int(attn.num_kv_heads_per_rank), head_dim=int(attn.head_dim),
                   vocab=int(cfg.vocab_size), dtype_bytes=model.dtype.itemsize,
                   kv_fp8=kv_cache_dtype == "fp8")


def kv_bytes_per_token(shape: ModelShape) -> int:
    """K and V of one token position in every layer (this rank's KV heads); fp8: one byte per
    element and a 4-byte scale per head."""
    if shape.kv_fp8:
        return 2 * shape.layers * shape.kv_heads * (shape.head_dim + 4)
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * shape.dtype_bytes


def activation_bytes_per_token(shape: ModelShape) -> int:
    """Peak activation bytes per token of one no-grad forward (layers run one after another, so
    one layer's temporaries are live at a time): the residual stream, the layer input and its
    norm (3 x hidden) plus the larger of the MLP (the fused gate/up output 2 x intermediate,
    SiLU(gate) and the product: 2 more, the down projection's output: hidden) and the attention
    (q, k, v and their rotary copies, the attention output and its projection)."""
    h, i = shape.hidden, shape.intermediate
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    mlp = 4 * i + h
    attention = 2 * qkv + shape.heads * shape.head_dim + h
    return shape.dtype_bytes * (3 * h + max(mlp, attention))


def sampling_bytes(shape: ModelShape, rows: int) -> int:
    """The sampler's fp32 temporaries over the full vocabulary for ``rows`` rows."""
    return rows * shape.vocab * 4 * SAMPLING_FLOATS_PER_VOCAB


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The engine's sizes: ``kv_tokens`` KV positions, prefill packs of ``prefill_tokens``; the
    numbers behind them in bytes (``available``: what the engine may still take)."""

    kv_tokens: int
    prefill_tokens: int
    available: int
    weights: int
    kv_per_token: int
    activation_per_token: int
    sampling: int

    def describe(self) -> str:
        return (f"KV {self.kv_tokens} tokens ({self.kv_tokens * self.kv_per_token / GIB:.2f} "
                f"GiB), prefill chunk {self.prefill_tokens} tokens "
                f"({self.prefill_tokens * self.activation_per_token / GIB:.2f} GiB), sampling "
                f"{self.sampling / GIB:.2f} GiB, of {self.available / GIB:.2f} GiB the engine "
                f"may use beside its weights ({self.weights / GIB:.2f} GiB)")


def plan_memory(shape: ModelShape, *, total: int, in_use: int, weights: int,
                utilization: float, longest_prompt: int, longest_row: int, rows: int,
                max_prefill_tokens: int, kv_budget_tokens: int | None = None) -> MemoryPlan:
    """The plan for a device of ``total`` bytes with ``in_use`` bytes taken (the rollout's
    ``weights`` included when they are on the device), requests whose longest prompt is
    ``longest_prompt`` tokens and longest row ``longest_row`` (prompt + max new tokens), at most
    ``rows`` rows decoding at once. ``kv_budget_tokens``: an explicit KV size (the override).
    Raises :class:`MemoryPlanError` when one row of the longest request cannot fit."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    kv_token = kv_bytes_per_token(shape)
    act_token = activation_bytes_per_token(shape)
    sampling = sampling_bytes(shape, rows) + 2 * rows * act_token
    available = int(utilization * total) - in_use
    need_kv = kv_budget_tokens or longest_row
    need = need_kv * kv_token + longest_prompt * act_token + sampling
    if available < need:
        what = (f"kv_budget_tokens={kv_budget_tokens}" if kv_budget_tokens else
                f"the minimum of {longest_row} tokens (longest prompt {longest_prompt} + "
                f"max_new_tokens {longest_row - longest_prompt})")
        raise MemoryPlanError(
            f"the rollout does not fit: gpu_memory_utilization={utilization} of "
            f"{total / GIB:.2f} GiB allows {utilization * total / GIB:.2f} GiB; "
            f"{in_use / GIB:.2f} GiB are in use (weights {weights / GIB:.2f} GiB), leaving "
            f"{max(available, 0) / GIB:.2f} GiB free for the engine; KV needs "
            f"{kv_token} bytes/token x {what} = {need_kv * kv_token / GIB:.2f} GiB, the longest "
            f"prompt's prefill {longest_prompt * act_token / GIB:.2f} GiB and sampling "
            f"{sampling / GIB:.2f} GiB ({need / GIB:.2f} GiB in all). Raise "
            f"rollout.gpu_memory_utilization, offload the training state (trainer.offload), "
            f"shorten the prompts / max_new_tokens, or use more tensor-parallel ranks")
    left = available - sampling
    if kv_budget_tokens:
        kv_tokens = int(kv_budget_tokens)
        chunk = (left - kv_tokens * kv_token) // act_token
        chunk = max(longest_prompt, min(max_prefill_tokens, chunk))
    else:
        chunk = min(max_prefill_tokens, int(PREFILL_SHARE * left) // act_token)
        chunk = max(longest_prompt, chunk)
        kv_tokens = (left - chunk * act_token) // kv_token
        kv_tokens = max(longest_row, min(kv_tokens, rows * longest_row))
    return MemoryPlan(kv_tokens=int(kv_tokens), prefill_tokens=int(chunk), available=available,
                      weights=weights, kv_per_token=kv_token, activation_per_token=act_token,
                      sampling=sampling)


def device_memory(device) -> tuple[int, int] | None:
    """``(total, in_use)`` bytes of a CUDA ``device`` (memory PyTorch's allocator holds but does
    not use counts as free); None elsewhere (no device memory to plan)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(total), int(total - free - cached)


def weight_bytes(model) -> int:
    """Bytes of ``model``'s parameters and buffers on this rank (tied tensors once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def plan_for_model(model, *, utilization: float, longest_prompt: int, longest_row: int,
                   rows: int, max_prefill_tokens: int,
                   kv_budget_tokens: int | None = None,
                   kv_cache_dtype: str = "bf16") -> MemoryPlan | None:
    """:func:`plan_memory` for ``model`` (its KV pool in ``kv_cache_dtype``) on its device now;
    None off CUDA."""
    memory = device_memory(model.device)
    if memory is None:
        return None
    total, in_use = memory
    return plan_memory(ModelShape.of(model, kv_cache_dtype), total=total, in_use=in_use,
                       weights=weight_bytes(model), utilization=utilization,
                       longest_prompt=longest_prompt, longest_row=longest_row, rows=rows,
                       max_prefill_tokens=max_prefill_tokens, kv_budget_tokens=kv_budget_tokens)


__all__ = ["DEFAULT_GPU_MEMORY_UTILIZATION", "MemoryPlan", "MemoryPlanError", "ModelShape",
           "activation_bytes_per_token", "device_memory", "kv_bytes_per_token", "plan_for_model",
           "plan_memory", "sampling_bytes", "weight_bytes"]
