"""Programmatic dependent launch (PDL, Hopper and later) for the FP8 decode kernels: a kernel
launched with it may start while the kernel before it on the stream is still running, so its
launch, its prologue and the first weight reads overlap that kernel's tail instead of following
it. A CUDA graph captured from such launches keeps them as programmatic edges. CUDA only;
imported lazily (triton is not a dependency).

The contract every kernel launched with :func:`launch_options` keeps (``PDL`` its constexpr):

- before it reads anything an earlier kernel may write (activations, scales, the split-K
  workspace) or writes anything, it calls :func:`wait_for_inputs` (``griddepcontrol.wait``:
  returns once the kernel before it has completed and its writes are visible; that kernel
  waited for its own predecessor the same way, so every earlier kernel has completed too);
- before that wait it touches only the weights, which no kernel of the step writes: the decode
  GEMMs prefetch the start of their weight strip into L2 (:func:`prefetch_rows`);
- after the wait it calls :func:`release_dependents`, so the next kernel may launch (it waits in
  its turn); releasing only after the wait keeps at most two kernels resident at a time, so the
  prefetches of one GEMM do not evict another's.

A kernel before a PDL one that does not release (torch's, cuBLAS's) releases implicitly as its
programs exit. Off in Triton's CPU interpreter and below compute capability 9.0, and where
``PARALLEL_MODELS_FP8_PDL=0`` (docs/PERFORMANCE.md has the step time both ways).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENV = "PARALLEL_MODELS_FP8_PDL"
# bytes of weights a decode GEMM program prefetches to L2 before its wait (0: none)
PREFETCH_BYTES = tl.constexpr(int(os.environ.get("PARALLEL_MODELS_FP8_PREFETCH_KB", "64")) * 1024)

try:  # (triton >= 3.4)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (see the module docstring)."""
    if device.type != "cuda" or gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get(ENV, "1") == "0":
        return False
    return _device_supports(device.index if device.index is not None
                            else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """A PDL kernel's launch keywords on ``device``: its ``PDL`` constexpr and Triton's
    ``launch_pdl`` (both off where :func:`enabled` is False)."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Block until the kernel before this one completed (a no-op unless ``PDL``)."""
    if PDL:
        gdc_wait()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """Let the next kernel on the stream launch (a no-op unless ``PDL``)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_rows(W, rows, N, stride_w, k_begin, k_end, PDL: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Prefetch to L2 the first bytes of weight rows ``rows`` (``BLOCK_N`` of them, clamped to
    ``N``) of the 1-byte ``W`` from column ``k_begin`` on: :data:`PREFETCH_BYTES` in all, at
    most up to ``k_end`` (one bulk prefetch per row; ``stride_w``, ``k_begin`` and ``k_end`` multiples
    of 16 bytes). A no-op unless ``PDL``."""
    if PDL and PREFETCH_BYTES > 0:
        per_row: tl.constexpr = (PREFETCH_BYTES // BLOCK_N) // 16 * 16
        nbytes = tl.minimum(k_end - k_begin, per_row)
        ptrs = W + tl.minimum(rows, N - 1).to(tl.int64) * stride_w + k_begin
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // dummy $0",
                                  "=r,l,r", [ptrs, nbytes.to(tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)


__all__ = ["ENV", "PREFETCH_BYTES", "enabled", "launch_options", "prefetch_rows",
           "release_dependents", "wait_for_inputs"]
