"""What the FP8 decode GEMM kernels (``weight_only_kernel``: W8A16; ``dynamic_act_kernel``: W8A8
with the activations quantized in the kernel) share: the program -> tile mapping, the split-K
hand-over of the fp32 partial sums, its workspace, and the launch (CUDA; imported lazily: triton
is not a dependency).

- Programs: one per (row tile, K split, ``block_n`` strip of output features); the program index
  runs over row tiles first, so the row tiles of one weight strip are neighbours (the strip's
  second read hits the L2 cache), then over the K splits.
- Split K: where the output has too few strips to fill the SMs, ``split_k`` programs share a
  tile's K range: each writes its fp32 partial sum to a workspace and counts itself in on an
  atomic counter; the last one adds the partials in split order (deterministic), and resets the
  counter to 0 (so a kernel needs no zeroing launch and a CUDA graph replays it as it is).
- The workspace and counters belong to one (device, split, row bucket, out) and are kept for the
  process (a captured graph holds their addresses); both kernels use the same ones (launches on
  one stream at a time).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from parallel_models.inference.fp8 import decode_tuning
from parallel_models.inference.fp8.decode_tuning import DecodeConfig
from parallel_models.inference.fp8.quantize import BLOCK, QuantizedWeight


@triton.jit
def program_tile(M, K, SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """-> (row tile, K split, strip, row tiles, first K, end of K) of this program."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m  # row tiles of one weight strip are neighbours: the strip hits L2
    pid_k = (pid // num_m) % SPLIT_K
    pid_n = pid // (num_m * SPLIT_K)
    k_span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = tl.multiple_of(pid_k * k_span, BLOCK_K)
    k_end = tl.minimum(k_begin + k_span, K)
    return pid_m, pid_k, pid_n, num_m, k_begin, k_end


@triton.jit
def tile_pointers(X, W, S, M, N, pid_m, pid_n, k_begin, stride_xm, stride_wn, stride_sn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr,
                  GROUP: tl.constexpr):
    """-> (weight rows ``rn``, activation rows ``rm``, their masks, the weight tile's pointers
    ``[BLOCK_N, WIDTH]``, the activation tile's ``[WIDTH, BLOCK_M]`` at ``k_begin``, the strip's
    first block-scale row) of a program's tile."""
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, WIDTH)
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + (k_begin + rk)[None, :]
    x_ptrs = X + rm[None, :].to(tl.int64) * stride_xm + (k_begin + rk)[:, None]
    scale_row = S + ((pid_n * BLOCK_N) // GROUP) * stride_sn
    return rn, rm, rn < N, rm < M, w_ptrs, x_ptrs, scale_row


@triton.jit
def tile_offsets(rm, rn, stride_m, TOKENS_FIRST: tl.constexpr):
    """Offsets of a tile's elements in a row-major ``[rows, out]`` array (``stride_m`` apart):
    ``[BLOCK_N, BLOCK_M]`` (weight rows first) or, ``TOKENS_FIRST``, ``[BLOCK_M, BLOCK_N]``."""
    if TOKENS_FIRST:
        return rm[:, None].to(tl.int64) * stride_m + rn[None, :]
    else:
        return rm[None, :].to(tl.int64) * stride_m + rn[:, None]


@triton.jit
def hand_over_splits(acc, P, C, rm, rn, write, pid_m, pid_k, pid_n, num_m, N, ws_rows, SPLIT_K,
                     BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                     TOKENS_FIRST: tl.constexpr = False):
    """The split-K hand-over of an ``[BLOCK_N, BLOCK_M]`` fp32 tile (``TOKENS_FIRST``: ``[BLOCK_M,
    BLOCK_N]``): -> (the tile's full sum in its last split, the write mask: false in every other
    split)."""
    if SPLIT_K > 1:
        part_ptrs = P + tile_offsets(rm, rn, N, TOKENS_FIRST)
        tl.store(part_ptrs + pid_k * ws_rows * N, acc, mask=write)
        tl.debug_barrier()  # every thread's partial stored before the release below
        tile = pid_n * num_m + pid_m
        arrived = tl.atomic_add(C + tile, 1)  # acq_rel, GPU scope
        last = arrived == SPLIT_K - 1
        if last:  # the tile's last split: add the partials in split order
            acc = tl.zeros(acc.shape, dtype=tl.float32)
            for split in range(SPLIT_K):
                acc += tl.load(part_ptrs + split * ws_rows * N, mask=write, other=0.0,
                               cache_modifier=".cg")
            tl.atomic_xchg(C + tile, 0)
        write = write & last
    return acc, write


@triton.jit
def finish_tile(acc, Y, S, P, C, rm, rn, n_ok, m_ok, pid_m, pid_k, pid_n, num_m, N, ws_rows,
                stride_ym, SPLIT_K, BLOCK_SCALES: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_M: tl.constexpr, TOKENS_FIRST: tl.constexpr = False):
    """A program's ``[BLOCK_N, BLOCK_M]`` fp32 tile (``TOKENS_FIRST``: ``[BLOCK_M, BLOCK_N]``)
    to ``Y`` (``[rows, out]``): the split-K hand-over (only the tile's last split writes),
    channel scales (``S[out]``, where not ``BLOCK_SCALES``: those were applied per K step) and
    the cast to ``Y``'s dtype."""
    if TOKENS_FIRST:
        write = m_ok[:, None] & n_ok[None, :]
    else:
        write = n_ok[:, None] & m_ok[None, :]
    acc, write = hand_over_splits(acc, P, C, rm, rn, write, pid_m, pid_k, pid_n, num_m, N,
                                  ws_rows, SPLIT_K, BLOCK_N, BLOCK_M, TOKENS_FIRST)
    if not BLOCK_SCALES:
        scale = tl.load(S + rn, mask=n_ok, other=0.0)
        if TOKENS_FIRST:
            acc = acc * scale[None, :]
        else:
            acc = acc * scale[:, None]
    tl.store(Y + tile_offsets(rm, rn, stride_ym, TOKENS_FIRST), acc.to(Y.dtype.element_ty),
             mask=write)


_workspaces: dict = {}  # (device, split, row bucket, out) -> (fp32 partials, int32 counters)
_captured: set = set()  # workspaces a CUDA graph captured: kept whatever was chosen


def workspace(device: torch.device, split: int, rows: int, out: int):
    """(fp32 partials ``[split, bucket, out]``, int32 counters) of a K-split launch."""
    key = (str(device), split, decode_tuning.row_bucket(rows), out)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _captured.add(key)
    if key not in _workspaces:
        bucket = key[2]
        counters = -(-out // 16) * -(-bucket // 16)  # tiles of the smallest config (16 x 16)
        _workspaces[key] = (torch.empty(split, bucket, out, dtype=torch.float32, device=device),
                            torch.zeros(counters, dtype=torch.int32, device=device))
    return _workspaces[key]


@functools.lru_cache(maxsize=None)
def unused_pointers(device: torch.device):
    """(fp32, int32) one-element tensors on ``device``: pointer arguments a launch passes but
    its kernel does not read."""
    return (torch.zeros(1, dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))


def release_unused_workspaces() -> None:
    """Drop the split-K workspaces that no chosen config uses and no captured graph holds (the
    ones tuning tried)."""
    keep = _captured | {(key[4], cfg.split_k, key[0], key[1])
                        for key, cfg in decode_tuning.chosen_configs().items()}
    for key in list(_workspaces):
        if key not in keep:
            del _workspaces[key]


def launch(kernel, x2: torch.Tensor, weight: QuantizedWeight, y: torch.Tensor,
           cfg: DecodeConfig, extra: tuple = (), **constexprs) -> torch.Tensor:
    """Run a decode GEMM ``kernel`` with ``cfg`` (and the kernel's own arguments: ``extra``
    after the shared ones, ``constexprs``) into ``y`` ``[rows, out]`` (``x2`` unit-strided
    along K); returns ``y``. (The caller checks its K step against the scale blocks; a strip
    spans block rows only whole, checked here.)"""
    rows, inp = x2.shape
    out = weight.shape[0]
    block = weight.granularity == "block"
    if block and BLOCK % cfg.block_n and cfg.block_n % BLOCK:
        raise ValueError(f"fp8 decode GEMM: {cfg} crosses the 128 x 128 scale blocks")
    if cfg.split_k > 1:
        partials, counters = workspace(x2.device, cfg.split_k, rows, out)
        ws_rows = partials.shape[1]
    else:  # (not read by the kernel: pointers of the right types)
        partials, counters = unused_pointers(x2.device)
        ws_rows = 0
    scale = weight.scale
    kernel[(cfg.grid(rows, out),)](
        x2, weight.data, scale, y, partials, counters, rows, out, inp, x2.stride(0),
        weight.data.stride(0), y.stride(0), scale.stride(0) if block else 0, ws_rows,
        cfg.split_k, *extra, BLOCK_SCALES=block, EVEN_K=inp % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP=BLOCK,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **constexprs)
    return y


def product(kernel_name: str, launch_with, x2: torch.Tensor, weight: QuantizedWeight,
        config: DecodeConfig | None) -> torch.Tensor:
    """``[rows, out]`` output of ``launch_with(x2, weight, y, cfg)`` in ``x2``'s dtype, ``config``
    or (None) the one ``decode_tuning.choose`` settles on for ``kernel_name`` (timing the
    candidates on the first product of a new shape outside a graph capture)."""
    rows, inp = x2.shape
    out = weight.shape[0]
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(rows, out, dtype=x2.dtype, device=x2.device)
    if rows == 0:
        return y
    if config is None:
        tuned_before = len(decode_tuning.timings)
        config = decode_tuning.choose(rows, out, inp, weight.granularity, x2.device,
                                      lambda cfg: launch_with(x2, weight, y, cfg),
                                      kernel=kernel_name)
        if len(decode_tuning.timings) != tuned_before:
            release_unused_workspaces()
    launch_with(x2, weight, y, config)
    return y


__all__ = ["finish_tile", "hand_over_splits", "tile_offsets", "launch", "program_tile", "product",
           "release_unused_workspaces", "tile_pointers", "unused_pointers", "workspace"]
