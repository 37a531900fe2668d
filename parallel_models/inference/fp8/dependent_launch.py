"""Programmatic dependent launch for the FP8 decode kernels (Hopper's grid dependency control),
and the L2 prefetch it allows. CUDA, SM 9.0+; imported lazily, since triton is not a dependency.

A decode step is a chain of short kernels: RMSNorm, then the qkv GEMM, then attention, and so
on. Between two kernels of a CUDA graph the GPU idles: the second kernel launches, its programs
ramp up, their first loads wait on HBM. With a programmatic dependent launch (``launch_pdl``) the
second kernel may start while the first is still finishing. So before it waits for the first one
(``gdc_wait``), a decode GEMM asks the L2 cache for its slice of the weights
(:func:`prefetch_rows_to_l2`), which no kernel writes. The norm, the SwiGLU and the activation
quantization before it let it start (``gdc_launch_dependents``) once they have read their own
inputs.

Rules every kernel launched this way keeps:

- it calls ``gdc_wait`` before it reads anything an earlier kernel wrote;
- it calls ``gdc_wait`` before it writes anything (the split-K workspaces are shared between
  launches);
- it always calls ``gdc_wait``, so its completion implies its predecessor's.

A launch without a PDL-aware kernel before it behaves as before. :data:`ENABLED` is the switch;
:func:`use_pdl` says whether a launch on a device takes it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = True
"""Launch the FP8 decode GEMMs and their producers with programmatic dependent launch where the
GPU has it (SM 9.0+). False: plain launches (``bench/fp8_decode.py``'s ``/nopdl`` contenders)."""
PREFETCH = True
"""With programmatic dependent launch, the TMA GEMM's programs prefetch their weight rows into L2
before they wait (False: they only wait)."""
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def use_pdl(device: torch.device) -> bool:
    """Whether launches on ``device`` take programmatic dependent launch (read at each launch:
    a captured graph keeps what it captured)."""
    return ENABLED and not _INTERPRETED and _capable(device)


@triton.jit
def prefetch_rows_to_l2(ptrs, nbytes, mask):
    """Ask the L2 cache for ``nbytes`` bytes at each of ``ptrs`` (16-byte aligned, ``nbytes`` a
    multiple of 16) where ``mask``: one bulk prefetch per row, no registers filled."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptrs, tl.full(ptrs.shape, nbytes, tl.int32), mask.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


__all__ = ["ENABLED", "PREFETCH", "prefetch_rows_to_l2", "use_pdl"]
