"""Launch settings of the split-KV decode attention kernel (``split_kv_kernels.split_kernel``).

A :class:`LaunchConfig` is the tile over KV positions (``block_n``), ``num_warps``,
``num_stages`` and, optionally, the positions per split (``split``; None = the automatic
:func:`~parallel_models.inference.split_kv_attention.split_size`). Where it comes from, first
match wins:

1. the option ``decode_kernel_config`` (``parallel_models.options``; env
   ``PARALLEL_MODELS_DECODE_KERNEL_CONFIG``) ``"block_n,warps,stages"`` or
   ``"block_n,warps,stages,split"`` (every shape; benches and trying a sweep's result);
2. :data:`TUNED`: ``(min batch, min max_row_tokens, config)`` entries, the last entry whose
   minimums the bucket reaches (fill it from ``bench/decode_attention_sweep.py``'s best per
   shape);
3. :data:`DEFAULT`.

The option ``decode_split`` (a fixed split size) still overrides the split of all of them.
The config is read when a bucket's graph is captured (or at each eager call).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from parallel_models.errors import ConfigError
from parallel_models.options import env_var, option

SOURCE = f"decode_kernel_config ({env_var('decode_kernel_config')})"


@dataclass(frozen=True)
class LaunchConfig:
    block_n: int  # KV positions per tile (power of two >= 16)
    num_warps: int  # 1, 2, 4, 8 or 16
    num_stages: int  # software-pipelining depth of the tile loads (>= 1)
    split: int | None = None  # positions per split (power of two >= 16); None = automatic

    def __post_init__(self):
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ConfigError(f"split-KV block_n must be a power of two >= 16, got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ConfigError(f"split-KV num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ConfigError(f"split-KV num_stages must be >= 1, got {self.num_stages}")
        if self.split is not None and (self.split < 16 or self.split & (self.split - 1)):
            raise ConfigError(f"split-KV split must be a power of two >= 16, got {self.split}")

    def as_env(self) -> str:
        """The ``decode_kernel_config`` value (and environment value) selecting this config."""
        fields = (self.block_n, self.num_warps, self.num_stages) + (
            (self.split,) if self.split else ())
        return ",".join(str(f) for f in fields)


DEFAULT = LaunchConfig(block_n=64, num_warps=4, num_stages=2)
# (min batch, min max_row_tokens, config): the last entry the bucket reaches wins. Empty until a
# GPU sweep (bench/decode_attention_sweep.py) says better.
TUNED: list[tuple[int, int, LaunchConfig]] = []


@functools.cache
def parse(value: str) -> LaunchConfig:
    """``"block_n,warps,stages[,split]"`` -> :class:`LaunchConfig` (ConfigError naming the
    option and its environment variable when malformed)."""
    try:
        fields = [int(f) for f in value.split(",")]
    except ValueError:
        fields = []
    if len(fields) not in (3, 4):
        raise ConfigError(f"{SOURCE}={value!r}: expected 'block_n,warps,stages' or "
                          f"'block_n,warps,stages,split' (integers)")
    try:
        return LaunchConfig(*fields)
    except ConfigError as exc:
        raise ConfigError(f"{SOURCE}={value!r}: {exc}") from None


def launch_config(batch: int, max_row_tokens: int) -> LaunchConfig:
    """The kernel's launch settings for a bucket of ``batch`` rows of ``max_row_tokens``."""
    value = option("decode_kernel_config")
    if value:
        return parse(value)
    chosen = DEFAULT
    for min_batch, min_tokens, config in TUNED:
        if batch >= min_batch and max_row_tokens >= min_tokens:
            chosen = config
    return chosen


__all__ = ["DEFAULT", "LaunchConfig", "TUNED", "launch_config", "parse"]
