"""Programmatic dependent launch (PDL, Hopper and later) for the FP8 decode kernels and the
split-KV attention: a kernel launched with it may start while the kernel before it on the
stream is still running, so its launch and prologue overlap that kernel's tail instead of
following it. A CUDA graph captured from such launches keeps them as programmatic edges. CUDA
only; imported lazily (triton is not a dependency).

The contract every kernel launched with :func:`launch_options` keeps (``PDL`` its constexpr):

- before it reads anything an earlier kernel may write (activations, scales, the split-K
  workspace) or writes anything, it calls :func:`wait_for_inputs` (``griddepcontrol.wait``:
  returns once the kernel before it has completed and its writes are visible; that kernel
  waited for its own predecessor the same way, so every earlier kernel has completed too);
- after the wait it calls :func:`release_dependents`, so the next kernel may launch (it waits in
  its turn); releasing only after the wait keeps at most two kernels resident at a time.

Before its wait a decode GEMM may touch its weights, which no kernel of the step writes: it asks
L2 for the first lines of its weight rows (:func:`prefetch_weights`, ``prefetch.global.L2``, one
instruction per 128-byte line spread over the program's threads; :func:`prefetch_lines` sizes
it, ``PARALLEL_MODELS_FP8_PREFETCH_KB`` a program, 0 none), so the DRAM reads of its first K
steps overlap the end of the kernel before. (An earlier version used one bulk prefetch per
weight row, ``cp.async.bulk.prefetch.L2``, 64 or 256 KiB a program: the bulk requests queue in
the SM's TMA unit ahead of the tile loads, and the 8B step got slower, 5.25 / 4.91 ms against
4.84 ms; docs/PERFORMANCE.md, session 20.)

The split-KV decode attention launches the same way (``inference.split_kv_kernels``), switched
by its own variable, ``PARALLEL_MODELS_ATTENTION_PDL``: it serves the bf16 engine too.

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
ATTENTION_ENV = "PARALLEL_MODELS_ATTENTION_PDL"
PREFETCH_ENV = "PARALLEL_MODELS_FP8_PREFETCH_KB"
PREFETCH_KB = 32  # weights a decode GEMM program asks L2 for before its wait, by default
LINE = 128  # bytes of an L2 line: one prefetch instruction

try:  # (triton >= 3.4)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device, env: str = ENV) -> bool:
    """Whether kernels on ``device`` launch with PDL (see the module docstring); ``env``: the
    variable that turns them off (``0``)."""
    if device.type != "cuda" or gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get(env, "1") == "0" or decode_tuning.timing():
        return False
    return _device_supports(device.index if device.index is not None
                            else torch.cuda.current_device())


def launch_options(device: torch.device, env: str = ENV) -> dict:
    """A PDL kernel's launch keywords on ``device``: its ``PDL`` constexpr and Triton's
    ``launch_pdl`` (both off where :func:`enabled` is False)."""
    on = enabled(device, env)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


def lines_for(budget: int, weight_rows: int, k_span: int) -> int:
    """128-byte lines a weight row that keep a program of ``weight_rows`` rows within ``budget``
    bytes of prefetch: a power of two, at least one, at most ``k_span`` inputs' worth; 0 where
    ``budget`` is 0."""
    if budget <= 0:
        return 0
    lines = max(1, min(budget // (weight_rows * LINE), max(1, k_span // LINE)))
    return 1 << (lines.bit_length() - 1)


def prefetch_lines(device: torch.device, weight_rows: int, k_span: int) -> int:
    """``LINES`` of :func:`prefetch_weights` for a program of ``weight_rows`` rows and ``k_span``
    inputs on ``device``: :func:`lines_for` ``PARALLEL_MODELS_FP8_PREFETCH_KB`` (default
    :data:`PREFETCH_KB`); 0 where PDL is off (nothing runs before the wait to overlap)."""
    if not enabled(device):
        return 0
    return lines_for(int(os.environ.get(PREFETCH_ENV, PREFETCH_KB)) * 1024, weight_rows, k_span)


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
def prefetch_weights(W, rows, N, stride_w, k_begin, k_end, LINES: tl.constexpr):
    """Ask L2 for ``LINES`` 128-byte lines of each weight row ``rows`` (clamped to ``N``) of the
    1-byte ``W`` from input ``k_begin`` on (clamped below ``k_end``): a no-op where ``LINES`` is
    0. Only weights: called before :func:`wait_for_inputs`."""
    if LINES > 0:
        cols = tl.minimum(k_begin + tl.arange(0, LINES) * 128, k_end - 1)
        ptrs = (W + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_w + cols[None, :])
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


__all__ = ["ATTENTION_ENV", "ENV", "LINE", "PREFETCH_ENV", "PREFETCH_KB", "enabled",
           "launch_options", "lines_for", "prefetch_lines", "prefetch_weights",
           "release_dependents", "wait_for_inputs"]
