"""Split-KV (flash-decoding) attention of one decode token per row, straight from the KV pool.

Triton kernels for :class:`~parallel_models.inference.pool_cache.PoolKVCache` on CUDA: row
``i``'s keys/values sit at pool positions ``offsets[i] .. offsets[i] + used[i] - 1``, the last one
being the token decoded now (its k/v come in as ``k_new`` / ``v_new``).

- GQA-aware: one program handles ALL query heads of one KV head (padded to 16 rows for
  ``tl.dot``), so each KV byte is read from memory once (PyTorch's flash kernel reads it once per
  query head).
- Split-KV: program ``(row, kv head, split)`` covers positions ``split * split_size ..`` of its
  row; splits past the row's length do nothing. The grid is fixed by the bucket (rows,
  ``max_row_tokens``; :func:`split_size`), not by the lengths, so a CUDA graph captured once per
  bucket serves every later step; no host sync.
  A second small kernel merges the splits' partial outputs with their log-sum-exps (skipped when
  one split covers ``max_row_tokens``).
- The new token's k/v are written into the pool by the program whose split holds it, so the
  decode step needs no separate KV write (``index_copy_``) launches. Several entries of one row
  (a re-entry's new tokens fed in one step, ``decode_layout``; ``back``) read each other's k/v
  from the step's ``k_new`` / ``v_new``, never from the pool those programs are writing.

- An fp8 pool (``kv_scales``: e4m3 pools and fp32 scales per (position, KV head),
  ``pool_cache``): each tile loads its e4m3 keys / values and their scales; the scores are
  ``q . k_e4m3`` times the key's scale and the values' weights ``p`` times the value's scale, in
  fp32 (``q . (k_e4m3 * s) == (q . k_e4m3) * s``: the dequantization without a rounding of the
  dequantized values), and the new token is quantized (amax / 448 per KV head) as it is
  written. The step's own entries (the new token, a re-entry's ``back`` ones) are attended
  unquantized, from ``k_new`` / ``v_new``.

Launch settings (tile, warps, stages, split): ``split_kv_config`` (an env var or a table by shape).
The kernels live in ``split_kv_kernels``, imported lazily (:func:`available`): without triton
the cache keeps PyTorch's kernels.
Set ``TRITON_INTERPRET=1`` before importing triton to run the kernels on the CPU (tests).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from parallel_models.inference.kv_quant import dequantize_kv, quantize_kv
from parallel_models.inference.split_kv_config import LaunchConfig, launch_config
from parallel_models.options import option


def split_size(batch: int, kv_heads: int, max_row_tokens: int, device,
               config: LaunchConfig | None = None) -> int:
    """Positions per split for a bucket (fixed per bucket: part of its captured graph).

    Enough programs (rows x KV heads x splits) to fill the GPU twice over, no more splits than
    that (each split adds a partial output to combine; one split skips the combine pass), at
    least one tile (the launch config's ``block_n``); the option ``decode_split`` = a fixed
    size (a power of two >= 16) instead, else the launch config's ``split`` when it sets one
    (``config``; default: ``split_kv_config.launch_config`` of the bucket)."""
    fixed = option("decode_split")
    if fixed:
        return fixed
    config = config or launch_config(batch, int(max_row_tokens))
    if config.split:
        return config.split
    device = torch.device(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else 4
    splits = max(1, -(-2 * sms // max(batch * kv_heads, 1)))
    per_split = -(-max(int(max_row_tokens), 1) // splits)
    return max(config.block_n, 1 << (per_split - 1).bit_length())


@functools.cache
def available() -> bool:
    """True when triton imports (the kernels are compiled on first use)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken triton: PyTorch's kernels are used
        return False
    return True


@functools.cache
def supported(device: torch.device, dtype: torch.dtype, kv_heads: int, head_dim: int,
              fp8_kv: bool = False) -> bool:
    """Triton imports, ``head_dim`` suits the kernel, and the kernel matches SDPA (a few rows,
    several splits) on ``device`` in ``dtype`` (``fp8_kv``: on e4m3 pools with scales): checked
    once; a failure warns and returns False (the caller keeps PyTorch's kernels)."""
    if not available() or head_dim < 16 or head_dim & (head_dim - 1):
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        pool, rows, group = 300, 4, 2

        def rand(*shape):
            return torch.randn(*shape, device=device, dtype=dtype, generator=g)

        k_pool, v_pool = rand(pool, kv_heads, head_dim), rand(pool, kv_heads, head_dim)
        q, k_new, v_new = (rand(rows, kv_heads * group, head_dim), rand(rows, kv_heads, head_dim),
                           rand(rows, kv_heads, head_dim))
        offsets = torch.tensor([0, 10, 80, 200], device=device)
        used = torch.tensor([1, 64, 100, 33], device=device, dtype=torch.int32)
        scales = None
        if fp8_kv:
            (k_pool, k_scale), (v_pool, v_scale) = quantize_kv(k_pool), quantize_kv(v_pool)
            scales = (k_scale, v_scale)
        ref = reference_decode(q, k_new, v_new, k_pool.clone(), v_pool.clone(), offsets, used,
                               0.1, kv_scales=scales and (scales[0].clone(), scales[1].clone()))
        got = split_kv_decode(q, k_new, v_new, k_pool, v_pool, offsets, used, 100, 0.1, split=32,
                              kv_scales=scales)
        err = ((got.float() - ref.float()).abs() - 2e-2 * ref.float().abs()).max().item()
        if not err < 3e-2:  # bf16: a few units in the last place of outputs up to ~4
            raise AssertionError(f"error {err} vs SDPA (beyond 2% of the value)")
    except Exception as exc:  # noqa: BLE001 - any failure: PyTorch's kernels instead
        warnings.warn(f"split-KV triton decode attention disabled: {type(exc).__name__}: {exc}")
        return False
    return True


@functools.cache
def rope_supported(device: torch.device, dtype: torch.dtype, kv_heads: int,
                   head_dim: int) -> bool:
    """The in-kernel RoPE (``rope=``) matches ``apply_rotary`` then the kernel without it on
    ``device``: checked once (call it before any graph capture); a failure warns and returns
    False (the rotary kernels stay apart)."""
    if not supported(device, dtype, kv_heads, head_dim):
        return False
    from parallel_models.llama.layers.rotary import apply_rotary

    try:
        g = torch.Generator(device=device).manual_seed(1)
        rows, pool, group = 3, 200, 2

        def rand(*shape):
            return torch.randn(*shape, device=device, dtype=dtype, generator=g)

        q, k_new, v_new = (rand(rows, kv_heads * group, head_dim),
                           rand(rows, kv_heads, head_dim), rand(rows, kv_heads, head_dim))
        k_pool, v_pool = rand(pool, kv_heads, head_dim), rand(pool, kv_heads, head_dim)
        cos, sin = rand(rows, head_dim).cos(), rand(rows, head_dim).sin()
        offsets = torch.arange(rows, device=device) * 60
        used = (torch.arange(rows, device=device, dtype=torch.int32) * 25 + 1)
        want = split_kv_decode(apply_rotary(q, cos, sin), apply_rotary(k_new, cos, sin), v_new,
                               k_pool.clone(), v_pool.clone(), offsets, used, 60, 0.1, split=32)
        got = split_kv_decode(q, k_new, v_new, k_pool, v_pool, offsets, used, 60, 0.1, split=32,
                              rope=(cos, sin))
        err = ((got.float() - want.float()).abs() - 2e-2 * want.float().abs()).max().item()
        if not err < 3e-2:
            raise AssertionError(f"error {err} vs apply_rotary + the kernel")
    except Exception as exc:  # noqa: BLE001 - any failure: rotary kernels apart
        warnings.warn(f"split-KV in-kernel RoPE disabled: {type(exc).__name__}: {exc}")
        return False
    return True


def reference_decode(q, k_new, v_new, k_pool, v_pool, offsets, used, scale,
                     kv_scales=None) -> torch.Tensor:
    """What :func:`split_kv_decode` computes, with SDPA row by row (host loop: tests only);
    writes ``k_new`` / ``v_new`` into the pools like it (``kv_scales``: e4m3 pools, the new
    entries quantized into them and attended unquantized)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_pool.shape[1]
    for i, (start, n) in enumerate(zip(offsets.tolist(), used.tolist())):
        last = start + n - 1
        if kv_scales is None:
            k_pool[last], v_pool[last] = k_new[i], v_new[i]
            keys, values = k_pool[start:start + n], v_pool[start:start + n]
        else:
            (k_pool[last], kv_scales[0][last]), (v_pool[last], kv_scales[1][last]) = (
                quantize_kv(k_new[i]), quantize_kv(v_new[i]))
            keys = torch.cat([dequantize_kv(k_pool[start:last], kv_scales[0][start:last],
                                            q.dtype), k_new[i][None]])
            values = torch.cat([dequantize_kv(v_pool[start:last], kv_scales[1][start:last],
                                              q.dtype), v_new[i][None]])
        keys = keys.transpose(0, 1).repeat_interleave(group, 0)
        values = values.transpose(0, 1).repeat_interleave(group, 0)
        out[i] = torch.nn.functional.scaled_dot_product_attention(
            q[i][:, None], keys, values, scale=scale)[:, 0]
    return out


@functools.cache
def _kernels():
    import triton

    from parallel_models.inference import split_kv_kernels
    from parallel_models.inference.fp8 import dependent_launch

    def launch_options(device):  # (programmatic dependent launch where it is on)
        return dependent_launch.launch_options(device, dependent_launch.ATTENTION_ENV)

    return (triton, split_kv_kernels.split_kernel, split_kv_kernels.combine_kernel,
            launch_options)


def split_kv_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    k_pool: torch.Tensor, v_pool: torch.Tensor, offsets: torch.Tensor,
                    used: torch.Tensor, max_row_tokens: int, scale: float,
                    split: int | None = None,
                    config: LaunchConfig | None = None, rope=None,
                    back: torch.Tensor | None = None, kv_scales=None) -> torch.Tensor:
    """Attention of one query token per row over its pool region; writes ``k_new`` / ``v_new``
    at ``offsets + used - 1`` of the pools.

    ``q`` ``[B, heads, D]``; ``k_new`` / ``v_new`` ``[B, kv_heads, D]``; ``k_pool`` / ``v_pool``
    ``[positions, kv_heads, D]`` (one layer); ``offsets`` ``[B]`` region starts; ``used`` ``[B]``
    positions per row including the new one (>= 1, <= ``max_row_tokens``). -> ``[B, heads, D]``.
    ``config``: the launch settings (default: ``split_kv_config.launch_config`` of the bucket);
    ``split`` overrides its split size. ``rope``: ``(cos, sin)`` ``[B, D]`` to rotate ``q`` and
    ``k_new`` in the kernel (they come in unrotated; the pool gets the rotated k).
    ``back``: ``[B]`` int32, how many entries right before each one belong to the same row
    (consecutive positions of one region, a fed re-entry: ``decode_layout``); an entry reads
    their k / v from ``k_new`` / ``v_new``, not the pool. Default: none (0).
    ``kv_scales``: ``(k_scale, v_scale)`` fp32 ``[positions, kv_heads]`` of e4m3 pools (the
    new k / v quantized into them as they are written); None: the pools in ``q``'s dtype.
    """
    triton, split_kernel, combine_kernel, launch_options = _kernels()
    b, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    if heads % kv_heads or dim & (dim - 1) or dim < 16:
        raise ValueError(f"split-KV decode needs heads ({heads}) a multiple of kv heads "
                         f"({kv_heads}) and a power-of-two head_dim >= 16 (got {dim})")
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new), ("k_pool", k_pool),
                    ("v_pool", v_pool)):
        if t.stride(-1) != 1:
            raise ValueError(f"split-KV decode needs {name} contiguous in head_dim")
    if k_pool.stride() != v_pool.stride():
        raise ValueError("split-KV decode needs the k and v pools laid out alike")
    if config is None:
        config = launch_config(b, int(max_row_tokens))
    if split is None:
        split = split_size(b, k_pool.shape[1], max_row_tokens, q.device, config)
    if split < 16 or split & (split - 1):
        raise ValueError(f"split size must be a power of two >= 16, got {split}")
    block_n = min(config.block_n, split)
    group = heads // kv_heads
    num_splits = triton.cdiv(max(int(max_row_tokens), 1), split)
    out = torch.empty_like(q)
    if num_splits > 1:
        part_out = torch.empty(b, heads, num_splits, dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(b, heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    if rope is not None:
        cos, sin = rope
        if cos.shape != (b, dim) or sin.shape != cos.shape or cos.stride(-1) != 1 \
                or sin.stride() != cos.stride():
            raise ValueError(f"split-KV decode rope needs cos / sin [{b}, {dim}] alike, "
                             f"contiguous in head_dim (got {tuple(cos.shape)})")
    else:
        cos = sin = q  # unused
    if back is None:
        back = torch.zeros(b, dtype=torch.int32, device=q.device)
    k_scale, v_scale = kv_scales if kv_scales is not None else (q, q)  # (q: unused)
    if kv_scales is not None and (k_pool.dtype != torch.float8_e4m3fn
                                  or k_scale.shape != k_pool.shape[:2]
                                  or k_scale.stride() != v_scale.stride()
                                  or k_scale.stride(1) != 1):
        raise ValueError("split-KV decode kv_scales needs e4m3 pools and fp32 scales "
                         "[positions, kv_heads] alike, contiguous in the heads")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    pdl = launch_options(q.device)
    split_kernel[(b, kv_heads, num_splits)](
        q, k_new, v_new, k_pool, v_pool, offsets, used, back, out, part_out, part_lse, cos, sin,
        k_scale, v_scale, scale,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1), k_pool.stride(0),
        k_pool.stride(1), out.stride(0), out.stride(1), cos.stride(0), k_scale.stride(0),
        G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_N=block_n,
        SPLIT=split, NUM_SPLITS=num_splits, H=heads, IEEE=q.dtype == torch.float32,
        RUNTIME_LOOP=not interpreted, ROPE=rope is not None, FP8_KV=kv_scales is not None,
        INTERPRETED=interpreted,
        # the interpreter loops a fixed count over a row's earlier entries (compiled: any)
        MAX_BACK=int(back.max()) if interpreted else 0,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl)
    if num_splits > 1:
        combine_kernel[(b, heads)](part_out, part_lse, used, out, out.stride(0), out.stride(1),
                                   H=heads, D=dim, SPLIT=split, NUM_SPLITS=num_splits,
                                   BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
                                   num_warps=4, **pdl)
    return out


__all__ = ["available", "split_size", "reference_decode", "rope_supported", "split_kv_decode",
           "supported"]
