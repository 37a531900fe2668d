"""Causal attention over packed (variable-length) sequences, best kernel first.

1. flash-attn's ``flash_attn_varlen_func`` when it is installed (CUDA, fp16/bf16) and the option
   ``disable_flash_attn`` is off (``PARALLEL_MODELS_DISABLE_FLASH_ATTN``; read at first use);
2. CUDA fp16/bf16 without it, PyTorch's own kernels (bench/attention_bench.py measures them):
   - every sequence of the same length (a full batch): one batched SDPA call (cuDNN on Hopper);
   - ragged: PyTorch's varlen flash kernel, called with the KV heads as they are (GQA);
3. ``F.scaled_dot_product_attention`` per sequence (any device and dtype; the CPU path).
All take q ``[tokens, heads, d]``, k/v ``[tokens, kv_heads, d]`` and ``cu_seqlens`` (int32, n+1).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from parallel_models.llama.layers import exact
from parallel_models.options import option


@functools.cache
def _flash_attn_varlen():
    if option("disable_flash_attn"):
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch: fall back
        return None
    return flash_attn_varlen_func


@functools.cache
def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None, False, False
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "window_size" in params, "enable_gqa" in params


def available_backend(device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel ``varlen_causal_attention`` will use for this device and dtype."""
    half = dtype in (torch.float16, torch.bfloat16)
    if device.type == "cuda" and half:
        if _flash_attn_varlen() is not None:
            return "flash_attn"
        if _torch_varlen()[0] is not None:
            return "torch_varlen"
    return "sdpa"


def varlen_causal_attention(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int,
                            scale: float | None = None) -> torch.Tensor:
    if exact.enabled():  # one batch-invariant kernel for prefill, decode and training
        from parallel_models.llama.layers.exact import ops

        return ops.varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale,
                                    reference=varlen_causal_attention)
    backend = available_backend(q.device, q.dtype)
    if backend == "flash_attn":
        return _flash_attn_varlen()(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                    softmax_scale=scale, causal=True)
    if backend == "torch_varlen":
        num_seqs = cu_seqlens.numel() - 1
        if num_seqs * max_seqlen == q.shape[0] and num_seqs > 0:  # equal lengths, no host sync
            return _sdpa_batched(q, k, v, num_seqs, scale)
        if _aten_flash_available():
            return _flash_varlen(q, k, v, cu_seqlens, max_seqlen, scale)
        return _torch_varlen_attn(q, k, v, cu_seqlens, max_seqlen, scale)
    return _sdpa_per_sequence(q, k, v, cu_seqlens, scale)


def _sdpa_batched(q, k, v, num_seqs: int, scale):
    """Equal-length sequences as one ``[B, heads, S, d]`` SDPA call: PyTorch picks its fastest
    causal kernel (cuDNN's flash attention on Hopper, measured 1.7x the varlen flash kernel)."""
    t, h, d = q.shape
    s = t // num_seqs
    out = F.scaled_dot_product_attention(
        q.view(num_seqs, s, h, d).transpose(1, 2), k.view(num_seqs, s, -1, d).transpose(1, 2),
        v.view(num_seqs, s, -1, d).transpose(1, 2), is_causal=True, scale=scale,
        enable_gqa=k.shape[1] != h)
    return out.transpose(1, 2).reshape(t, h, d)


@functools.cache
def _aten_flash_available() -> bool:
    return hasattr(torch.ops.aten, "_flash_attention_forward")


def _flash_varlen(q, k, v, cu_seqlens, max_seqlen, scale):
    """PyTorch's flash kernel on packed tokens; the kernel reads GQA KV heads directly (no
    repeated K/V copies, unlike ``varlen_attn`` before torch 2.12). Autograd comes from the
    aten op's derivative (``_flash_attention_backward``)."""
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scale)
    return out[0]


def _torch_varlen_attn(q, k, v, cu_seqlens, max_seqlen, scale):
    varlen_attn, has_window, has_gqa = _torch_varlen()
    if k.shape[1] != q.shape[1] and not has_gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    kwargs = {"scale": scale}
    if k.shape[1] != q.shape[1]:
        kwargs["enable_gqa"] = True
    if has_window:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)


def _sdpa_per_sequence(q, k, v, cu_seqlens, scale):
    # One SDPA call per sequence: exact, no O(tokens^2) block mask; fine for CPU-sized batches.
    outs = []
    rep = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        qs = q[start:end].transpose(0, 1)
        ks = k[start:end].transpose(0, 1)
        vs = v[start:end].transpose(0, 1)
        if rep > 1:
            ks = ks.repeat_interleave(rep, dim=0)
            vs = vs.repeat_interleave(rep, dim=0)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        outs.append(o.transpose(0, 1))
    if not outs:
        return q.new_empty(q.shape)
    return torch.cat(outs, dim=0)
