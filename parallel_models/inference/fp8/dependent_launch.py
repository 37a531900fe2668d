"""Programmatic dependent launch (PDL, Hopper and later) for the FP8 decode kernels: a kernel
launched with it may start while the kernel before it on the stream is still running, so its
launch and prologue overlap that kernel's tail instead of following it. A CUDA graph captured from such launches keeps them as programmatic edges. CUDA only;
imported lazily (triton is not a dependency).

The contract every kernel launched with :func:`launch_options` keeps (``PDL`` its constexpr):

- before it reads anything an earlier kernel may write (activations, scales, the split-K
  workspace) or writes anything, it calls :func:`wait_for_inputs` (``griddepcontrol.wait``:
  returns once the kernel before it has completed and its writes are visible; that kernel
  waited for its own predecessor the same way, so every earlier kernel has completed too);
- after the wait it calls :func:`release_dependents`, so the next kernel may launch (it waits in
  its turn); releasing only after the wait keeps at most two kernels resident at a time.

Prefetching the start of a GEMM's weight strip into L2 before its wait (``cp.async.bulk.
prefetch.L2``, 64 or 256 KiB a program) was measured and dropped: the 8B decode step at 64 rows
took 5.25 / 4.91 ms with it against 4.84 ms without (H100, docs/PERFORMANCE.md, session 20).

A kernel before a PDL one that does not release (torch's, cuBLAS's) releases implicitly as its
programs exit. Off in Triton's CPU interpreter, below compute capability 9.0, while
``decode_tuning`` times candidates (a kernel timed alone has nothing to overlap), and where
``PARALLEL_MODELS_FP8_PDL=0`` (docs/PERFORMANCE.md has the step time both ways).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from parallel_models.inference.fp8 import decode_tuning

ENV = "PARALLEL_MODELS_FP8_PDL"

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
    if os.environ.get(ENV, "1") == "0" or decode_tuning.timing():
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


__all__ = ["ENV", "enabled", "launch_options", "release_dependents", "wait_for_inputs"]
