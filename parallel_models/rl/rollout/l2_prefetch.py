"""Weight prefetch into the GPU's L2 cache during a decode step (``PARALLEL_MODELS_DECODE_L2_PREFETCH``).

A decode step at a few dozen to a few hundred rows is a chain of small memory-bound kernels:
each GEMM reads its weight once, and its launch, ramp-up and tail leave HBM partly idle
(docs/PERFORMANCE.md: a 0.89B step's 65 GEMMs run at 1.4-2.8x their weight-read floor). The
weights do not depend on the step's data, so a side stream can pull the NEXT GEMM's weight into
L2 while the current kernel runs; that GEMM then finds part of its weight in L2. Hopper's bulk
prefetch (``cp.async.bulk.prefetch.L2``) does it without holding SMs: each thread of a tiny
kernel issues one request for a chunk and exits.

The schedule (:func:`prefetch_plan`): before each dense layer's qkv GEMM runs, prefetch its
o_proj weight (it arrives during attention); before o_proj, the gate_up weight; before gate_up,
the down weight; before down, the next layer's qkv weight (the LM head's after the last layer).
At most ``max_bytes`` of each weight, from its start (the GEMM's first CTAs read it first).
MoE layers are skipped (their experts' weights are read by routing).

Values do not change: a prefetch moves no data any kernel sees. The side stream joins the main
stream at the end of the step, so the step captures into one CUDA graph. Opt-in until measured
(``bench/decode_profile.py --variants ours l2_prefetch``): ``1`` on, anything else off; CUDA
on compute capability >= 9.0 only (the bulk prefetch is a Hopper instruction).
"""

from __future__ import annotations

import contextlib
import os

import torch

ENV = "PARALLEL_MODELS_DECODE_L2_PREFETCH"
ENV_MAX_BYTES = "PARALLEL_MODELS_DECODE_L2_PREFETCH_MAX_MB"
CHUNK_BYTES = 16384  # bytes one thread asks for (one bulk prefetch request)
THREADS = 128


def requested() -> bool:
    return os.environ.get(ENV, "0") == "1"


def supported(device: torch.device) -> bool:
    """CUDA on sm_90+ with triton importable."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def max_bytes_setting() -> int:
    """The per-weight prefetch cap (MiB in ``PARALLEL_MODELS_DECODE_L2_PREFETCH_MAX_MB``,
    default 24: about half of an H100's L2)."""
    raw = os.environ.get(ENV_MAX_BYTES, "24")
    try:
        mib = float(raw)
    except ValueError as err:
        raise ValueError(f"{ENV_MAX_BYTES}={raw!r}: expected a number of MiB") from err
    if mib <= 0:
        raise ValueError(f"{ENV_MAX_BYTES}={raw!r}: must be > 0")
    return int(mib * 2**20)


def prefetch_plan(model) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """``(module, weight)`` pairs: when ``module`` is about to run, prefetch ``weight`` (the
    schedule of the module doc). ``model``: our CausalLM (``model.model.layers``)."""
    layers = list(model.model.layers)
    plan: list[tuple[torch.nn.Module, torch.Tensor]] = []
    for i, layer in enumerate(layers):
        mlp = layer.mlp
        if not hasattr(mlp, "gate_up_proj"):  # an MoE layer: experts picked by routing
            continue
        attn = layer.self_attn
        if i + 1 < len(layers):
            following = layers[i + 1].self_attn.qkv_proj.weight
        else:
            following = model.output_weight()
        plan += [(attn.qkv_proj, attn.o_proj.weight), (attn.o_proj, mlp.gate_up_proj.weight),
                 (mlp.gate_up_proj, mlp.down_proj.weight), (mlp.down_proj, following)]
    return plan


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, THREADS: tl.constexpr):
        idx = tl.program_id(0) * THREADS + tl.arange(0, THREADS)
        off = idx.to(tl.int64) * CHUNK
        size = tl.minimum(nbytes - off, CHUNK).to(tl.int32)  # <= 0: past the end
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False, pack=1)

    return prefetch_kernel


_KERNEL = None


def prefetch(weight: torch.Tensor, max_bytes: int) -> None:
    """Ask L2 for the first ``max_bytes`` of ``weight`` (contiguous, 16-byte aligned) on the
    current stream."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernel()
    nbytes = min(weight.numel() * weight.element_size(), max_bytes) // 16 * 16
    if nbytes <= 0:
        return
    grid = (-(-nbytes // (CHUNK_BYTES * THREADS)),)
    _KERNEL[grid](weight.view(-1).view(torch.uint8), nbytes, CHUNK=CHUNK_BYTES, THREADS=THREADS,
                  num_warps=THREADS // 32)


class L2Prefetcher:
    """Runs :func:`prefetch_plan` on a side stream around a decode step
    (``with prefetcher.step(): ...``). ``issue`` is the prefetch function (a recorder in CPU
    tests)."""

    def __init__(self, model, max_bytes: int | None = None, issue=prefetch):
        self.plan = [(m, w) for m, w in prefetch_plan(model)
                     if w.is_contiguous() and w.data_ptr() % 16 == 0]
        self.max_bytes = max_bytes_setting() if max_bytes is None else max_bytes
        self.issue = issue
        self.device = next(model.parameters()).device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def _hook(self, weight):
        def pre(module, args):
            if self.stream is None:
                self.issue(weight, self.max_bytes)
                return
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self.issue(weight, self.max_bytes)
        return pre

    @contextlib.contextmanager
    def step(self):
        handles = [m.register_forward_pre_hook(self._hook(w)) for m, w in self.plan]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            if self.stream is not None:  # join: a CUDA graph capture ends on one stream
                torch.cuda.current_stream(self.device).wait_stream(self.stream)


def for_engine(model) -> L2Prefetcher | None:
    """A prefetcher for ``model``'s decode steps when requested and supported, else None."""
    device = next(model.parameters()).device
    if not requested() or not supported(device):
        return None
    return L2Prefetcher(model)


__all__ = ["ENV", "L2Prefetcher", "for_engine", "prefetch", "prefetch_plan", "requested",
           "supported"]
