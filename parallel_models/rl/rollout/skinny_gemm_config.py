"""Launch settings of the skinny decode GEMM (``skinny_gemm_kernels.skinny_kernel``).

A :class:`LaunchConfig` is the tile (``block_n`` rows of W, ``block_m`` rows of x, ``block_k``),
the number of K splits (``split_k``; 1 = no reduction), ``num_warps`` and ``num_stages`` (the
software-pipelining depth of the W / x loads). Where it comes from, first match wins:

1. ``PARALLEL_MODELS_DECODE_GEMM_CONFIG="block_n,block_m,block_k,split_k,warps,stages"`` (every
   shape; benches and trying a sweep's result);
2. :data:`TUNED`: ``(max rows, N, K) -> config`` for the decode buckets (the smallest entry of
   that N and K whose ``max rows`` holds the call's rows), filled from
   ``bench/decode_gemm_sweep.py``'s best per shape; an entry ``None`` says cuBLAS measured
   faster there (:func:`cublas_preferred`: the linears keep cuBLAS for that shape);
3. :func:`heuristic`: from the byte math below.

Byte math (H100: 132 SMs, ~3.35 TB/s; weights dominate: at M = 64 the 0.89B model's x is 256 KB
against 8-131 MB of W per linear). Each W byte is read once from HBM whatever the tile; what the
tile decides is (a) how many programs stream W at once: fewer than ~1 per SM leaves bandwidth
idle, so a small N is split over K rather than cut into thinner N tiles; (b) how often x is
re-read from L2: once per N tile, ``M / block_n`` times the W bytes, so thin N tiles are costly
at large M; (c) the fp32 partial sums of a split (``M * N * 4`` bytes per split, written to L2
and read back by the tile's last split): cheap next to W at decode sizes (2 MB for o_proj at
M = 64 and 4 splits vs 8 MB of W), but the last split of each tile reads all of its tile's
partials, which lengthens the kernel's tail as the split count grows.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from parallel_models.errors import ConfigError

ENV = "PARALLEL_MODELS_DECODE_GEMM_CONFIG"
MAX_ROWS = 256  # the largest decode bucket the kernel is meant for


def _pow2(v: int) -> bool:
    return v >= 1 and not v & (v - 1)


@dataclass(frozen=True)
class LaunchConfig:
    block_n: int  # rows of W per program (power of two >= 16)
    block_m: int  # rows of x per program (power of two >= 16)
    block_k: int  # K per pipelined step (power of two >= 16)
    split_k: int  # K splits summed in the kernel (>= 1; 1 = no reduction)
    num_warps: int  # 1, 2, 4, 8 or 16
    num_stages: int  # software-pipelining depth of the loads (>= 1)

    def __post_init__(self):
        for name in ("block_n", "block_m", "block_k"):
            v = getattr(self, name)
            if v < 16 or not _pow2(v):
                raise ConfigError(f"skinny GEMM {name} must be a power of two >= 16, got {v}")
        if self.split_k < 1:
            raise ConfigError(f"skinny GEMM split_k must be >= 1, got {self.split_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ConfigError(f"skinny GEMM num_warps must be 1, 2, 4, 8 or 16, got "
                              f"{self.num_warps}")
        if self.num_stages < 1:
            raise ConfigError(f"skinny GEMM num_stages must be >= 1, got {self.num_stages}")

    def as_env(self) -> str:
        """The :data:`ENV` value selecting this config."""
        return ",".join(str(v) for v in (self.block_n, self.block_m, self.block_k, self.split_k,
                                          self.num_warps, self.num_stages))


# (max rows, N, K) -> config, or None where cuBLAS is faster: the smallest max rows >= the call's
# rows among the entries of its N and K wins. Empty until a GPU sweep
# (bench/decode_gemm_sweep.py, which prints the lines to paste) says better than the heuristic.
TUNED: dict[tuple[int, int, int], LaunchConfig | None] = {}


@functools.cache
def parse(value: str) -> LaunchConfig:
    """``"block_n,block_m,block_k,split_k,warps,stages"`` -> :class:`LaunchConfig` (ConfigError
    naming :data:`ENV` when malformed)."""
    try:
        fields = [int(f) for f in value.split(",")]
    except ValueError:
        fields = []
    if len(fields) != 6:
        raise ConfigError(f"{ENV}={value!r}: expected 'block_n,block_m,block_k,split_k,warps,"
                          f"stages' (integers)")
    try:
        return LaunchConfig(*fields)
    except ConfigError as exc:
        raise ConfigError(f"{ENV}={value!r}: {exc}") from None


def block_m_for(rows: int) -> int:
    """x rows per program: all of them (padded to a power of two >= 16) up to 128; above, two or
    more M tiles of 128 (an accumulator of 256 columns is too many registers)."""
    return min(max(16, 1 << max(rows - 1, 0).bit_length()), 128)


@functools.cache
def heuristic(rows: int, n: int, k: int, sms: int = 132) -> LaunchConfig:
    """The byte-math default (module docstring): N tiles of 64 rows of W (128 above 64 rows:
    x is re-read once per N tile, ``rows / block_n`` times W's bytes); split K (powers of two,
    at most 8, each split at least 256 of K) until the programs cover the SMs; 128 of K per
    step, 4 stages (3 when x's tile is large), 4 warps (8 for M tiles of 128)."""
    block_m = block_m_for(rows)
    m_tiles = -(-rows // block_m)
    block_n = 64 if rows <= 64 else 128
    tiles = -(-n // block_n) * m_tiles
    split = 1
    while tiles * split < sms and split < 8 and k // (2 * split) >= 256:
        split *= 2
    block_k = 128 if block_m <= 64 else 64
    stages = 4 if block_m <= 64 else 3
    warps = 4 if block_m <= 64 else 8
    return LaunchConfig(block_n, block_m, block_k, split, warps, stages)


def _tuned(rows: int, n: int, k: int) -> tuple[bool, LaunchConfig | None]:
    """(whether a :data:`TUNED` entry holds the shape, its value)."""
    best = None
    for (max_rows, tn, tk), config in TUNED.items():
        if tn == n and tk == k and rows <= max_rows and (best is None or max_rows < best[0]):
            best = (max_rows, config)
    return (True, best[1]) if best else (False, None)


def cublas_preferred(rows: int, n: int, k: int) -> bool:
    """Whether the table says cuBLAS is faster at this shape (its entry is None) and the env
    var does not force a config."""
    if os.environ.get(ENV):
        return False
    found, config = _tuned(rows, n, k)
    return found and config is None


def launch_config(rows: int, n: int, k: int, sms: int = 132) -> LaunchConfig:
    """The kernel's launch settings for ``x [rows, k] @ W[n, k]^T``."""
    value = os.environ.get(ENV)
    if value:
        return parse(value)
    _, config = _tuned(rows, n, k)
    return config or heuristic(rows, n, k, sms)


__all__ = ["ENV", "LaunchConfig", "MAX_ROWS", "TUNED", "block_m_for", "cublas_preferred",
           "heuristic", "launch_config", "parse"]
