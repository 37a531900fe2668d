"""FP8 (e4m3) storage of KV entries: one fp32 scale per (position, KV head), ``amax / 448`` over
head_dim (1 for an all-zero head), the recipe of ``fp8.quantize``'s per-row activations. Used by
the continuous engine's fp8 KV pool (``pool_cache``, ``rollout.kv_cache_dtype=fp8``) and by the
split-KV kernel's reference and self-check (``split_kv_attention``)."""

from __future__ import annotations

import torch

from parallel_models.inference.fp8.quantize import quantize_activation

KV_CACHE_DTYPES = ("bf16", "fp8")  # bf16: the model's dtype (as before) | fp8: e4m3 + scales


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """``kv_cache_dtype`` if it is one of :data:`KV_CACHE_DTYPES`, else a ValueError naming
    them."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                         f"{kv_cache_dtype!r}")
    return kv_cache_dtype


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., heads, d]`` -> (e4m3 ``[..., heads, d]``, fp32 scales ``[..., heads]``)."""
    data, scale = quantize_activation(x.reshape(-1, x.shape[-1]), "channel")
    return data.view(x.shape), scale.view(x.shape[:-1])


def dequantize_kv(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What e4m3 ``data`` with its per-(position, head) ``scale`` stands for, in ``dtype``."""
    return (data.float() * scale[..., None]).to(dtype)


__all__ = ["KV_CACHE_DTYPES", "check_kv_cache_dtype", "dequantize_kv", "quantize_kv"]
