"""The FP8 rollout's persistent stream-K decode GEMM: ``y = x @ W^T`` with ``W`` in e4m3 (block or
channel scales) and ``x`` left in its 16-bit dtype (weight-only, "W8A16", as
``weight_only_kernel``), as one Triton kernel (CUDA; imported lazily: triton is not a
dependency). Decode kernel ``"stream_k"`` (``gemm.DECODE_KERNEL``).

Why: the split-K kernels launch one program per (K split, output strip). At decode sizes the
programs come in 1.7 waves on an H100's SMs for the 8B gate_up projection (Nsight Compute, issue
37 in docs/PERFORMANCE.md: the SMs were active 74 % of the kernel's time), and a strip count
that fills the SMs exactly is rare.

How: a fixed number of programs (``programs_per_sm`` per SM) each take one contiguous, equal
share of the product's K steps, the (output strip, K step) units laid end to end strip after
strip ("stream-K"), so every program has the same number of K steps, give or take one, and
there is no last wave. A program walks the strips its share touches; per strip, a K loop like
the split-K kernels' (the loads pipelined ``num_stages`` deep; the e4m3 weights converted to
bf16 in registers by ``weight_only_kernel``'s bit conversion, a bf16 tensor-core dot; block
scales per K step, which never crosses a scale block).

- A strip whose units all lie in one program is written straight to ``y``.
- A strip shared by several programs is added up like the split-K kernels' K splits: every
  contributor stores its fp32 partial sum in its own slot of the workspace and counts itself in
  on the strip's atomic counter; the last to arrive adds the partials in program order
  (deterministic), scales, writes ``y`` and resets the counter to 0 (no zeroing launch; a CUDA
  graph replays the kernel as it is). Each program keeps two slots: one for the strip it starts
  inside (possibly shared with the program before) and one for the strip it ends inside.
- One row tile only: ``block_m`` covers all the rows (decode buckets of at most 128 rows), so
  each weight byte is read from HBM once.

The hand-over sits after each strip's K loop, not inside one loop over all the units: Triton's
software pipeliner (3.6) does not pipeline a loop holding the barrier the hand-over needs.
The result is ``gemm.weight_only_matmul`` up to the accumulation order; ``gemm`` checks that once
per device before using the kernel.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from parallel_models.inference.fp8 import decode_tuning
from parallel_models.inference.fp8.decode_tuning import DecodeConfig
from parallel_models.inference.fp8.quantize import BLOCK, QuantizedWeight
from parallel_models.inference.fp8.weight_only_kernel import _e4m3_to_bf16
from parallel_models.llama.layers.exact import interpreter_fix

interpreter_fix.apply()  # (the CPU interpreter's loop bounds; nothing on the GPU)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL = "stream_k"  # weight-only (its name in ``decode_tuning``'s keys)
COUNTERS = 1 << 16  # strip counters per device (a strip of the smallest tiles: 32 features)


@triton.jit
def _hand_over(acc, P, C, pid, strip, start_unit, first_unit, units_per_program, K_STEPS,
               BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """A strip's sum as this program leaves it -> (the strip's full sum, whether this program
    writes it): itself where the strip is all its own, else the stream-K hand-over (module
    docstring)."""
    first_owner = first_unit // units_per_program
    last_owner = (first_unit + K_STEPS - 1) // units_per_program
    total = acc
    write = first_owner == last_owner
    if first_owner != last_owner:
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        own_slot = (start_unit // K_STEPS != strip).to(tl.int32)  # 0: the strip it started in
        tl.store(P + (pid * 2 + own_slot).to(tl.int64) * (BLOCK_N * BLOCK_M) + tile, acc)
        tl.debug_barrier()  # every thread's partial stored before the release below
        arrived = tl.atomic_add(C + strip, 1)  # acq_rel, GPU scope
        write = arrived == last_owner - first_owner
        total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if write:  # the last to arrive adds the contributors' partials in program order
            for owner in range(first_owner, last_owner + 1):
                slot = ((owner * units_per_program) // K_STEPS != strip).to(tl.int32)
                total += tl.load(P + (owner * 2 + slot).to(tl.int64) * (BLOCK_N * BLOCK_M)
                                 + tile, cache_modifier=".cg")
            tl.atomic_xchg(C + strip, 0)
    return total, write


@triton.jit(do_not_specialize=["M"])
def _stream_k_kernel(X, W, S, Y, P, C, M, N, K, stride_xm, stride_wn, stride_ym, stride_sn,
                     K_STEPS, UNITS, UNITS_PER_PROGRAM, BLOCK_SCALES: tl.constexpr,
                     EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP: tl.constexpr, BIT_CONVERT: tl.constexpr):
    pid = tl.program_id(0)
    start = pid * UNITS_PER_PROGRAM
    end = tl.minimum(start + UNITS_PER_PROGRAM, UNITS)
    rk = tl.arange(0, BLOCK_K)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    for strip in range(start // K_STEPS, (end - 1) // K_STEPS + 1):
        first_unit = strip * K_STEPS
        k_begin = (tl.maximum(start, first_unit) - first_unit) * BLOCK_K
        k_end = tl.minimum((tl.minimum(end, first_unit + K_STEPS) - first_unit) * BLOCK_K, K)
        rn = strip * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + (k_begin + rk)[None, :]
        x_ptrs = X + rm[None, :].to(tl.int64) * stride_xm + (k_begin + rk)[:, None]
        scale_row = S + ((strip * BLOCK_N) // GROUP) * stride_sn
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):  # the pipelined loop
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
                x = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            else:
                k_ok = k0 + rk < K
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            if BIT_CONVERT:
                w = _e4m3_to_bf16(w)
            else:
                w = w.to(x.dtype)
            if BLOCK_SCALES:
                if BLOCK_N <= GROUP:  # the tile lies inside one scale block row
                    acc += tl.dot(w, x) * tl.load(scale_row + k0 // GROUP)
                else:  # the tile spans block rows: a scale per weight row
                    row_scales = tl.load(S + (rn // GROUP) * stride_sn + k0 // GROUP,
                                         mask=n_ok, other=0.0)
                    acc += tl.dot(w, x) * row_scales[:, None]
            else:
                acc = tl.dot(w, x, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        total, write = _hand_over(acc, P, C, pid, strip, start, first_unit, UNITS_PER_PROGRAM,
                                  K_STEPS, BLOCK_N, BLOCK_M)
        if write:
            if not BLOCK_SCALES:
                total = total * tl.load(S + rn, mask=n_ok, other=0.0)[:, None]
            tl.store(Y + rm[None, :].to(tl.int64) * stride_ym + rn[:, None],
                     total.to(Y.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def plan(rows: int, out: int, inp: int, cfg: DecodeConfig, sms: int) -> tuple[int, int, int]:
    """(K steps a strip, units a program, programs) of a product with ``cfg``: ``cfg.
    programs_per_sm`` programs per SM share the units evenly (fewer where there are fewer
    units)."""
    k_steps = -(-inp // cfg.block_k)
    units = -(-out // cfg.block_n) * k_steps
    per_program = -(-units // (sms * max(cfg.programs_per_sm, 1)))
    return k_steps, per_program, -(-units // per_program)


_workspaces: dict = {}  # (device, floats) -> fp32 partials (kept: a captured graph holds them)


@functools.lru_cache(maxsize=None)
def _counters(device: torch.device) -> torch.Tensor:
    """The strip counters of ``device`` (zero between launches: the last contributor resets
    its strip's; one set serves every launch on the device's one decode stream)."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def _partials(device: torch.device, programs: int, cfg: DecodeConfig) -> torch.Tensor:
    """Two ``[block_n, block_m]`` fp32 slots per program, shared by the launches of one size."""
    key = (str(device), programs * 2 * cfg.block_n * cfg.block_m)
    if key not in _workspaces:
        _workspaces[key] = torch.empty(key[1], dtype=torch.float32, device=device)
    return _workspaces[key]


def launch(x2: torch.Tensor, weight: QuantizedWeight, y: torch.Tensor,
           cfg: DecodeConfig) -> torch.Tensor:
    """Run the kernel with ``cfg`` into ``y`` ``[rows, out]`` (``x2`` unit-strided along K);
    returns ``y``."""
    rows, inp = x2.shape
    out = weight.shape[0]
    block = weight.granularity == "block"
    if rows > cfg.block_m:
        raise ValueError(f"fp8 stream-K decode GEMM: {cfg} takes at most {cfg.block_m} rows, "
                         f"got {rows}")
    if block and (BLOCK % cfg.block_k or (BLOCK % cfg.block_n and cfg.block_n % BLOCK)):
        raise ValueError(f"fp8 stream-K decode GEMM: {cfg} crosses the 128 x 128 scale blocks")
    if -(-out // cfg.block_n) > COUNTERS:
        raise ValueError(f"fp8 stream-K decode GEMM: {out} outputs exceed its {COUNTERS} strips")
    k_steps, per_program, programs = plan(rows, out, inp, cfg,
                                          decode_tuning.sm_count(x2.device))
    scale = weight.scale
    _stream_k_kernel[(programs,)](
        x2, weight.data, scale, y, _partials(x2.device, programs, cfg), _counters(x2.device),
        rows, out, inp, x2.stride(0), weight.data.stride(0), y.stride(0),
        scale.stride(0) if block else 0, k_steps, -(-out // cfg.block_n) * k_steps,
        per_program, BLOCK_SCALES=block, EVEN_K=inp % cfg.block_k == 0, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP=BLOCK,
        BIT_CONVERT=x2.dtype == torch.bfloat16 and not _INTERPRETED,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def stream_k_mm(x2: torch.Tensor, weight: QuantizedWeight,
                config: DecodeConfig | None = None) -> torch.Tensor:
    """``x2 @ dequantize(W)^T`` for ``x2`` ``[rows, in]`` (CUDA: bf16/fp16; the interpreter:
    fp32 too), in ``x2``'s dtype; ``config``: these tiles (default: ``decode_tuning.choose``
    among this kernel's candidates, timed on the first product of a new shape outside a graph
    capture)."""
    rows = x2.shape[0]
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(rows, weight.shape[0], dtype=x2.dtype, device=x2.device)
    if rows == 0:
        return y
    if config is None:
        config = decode_tuning.choose(rows, weight.shape[0], x2.shape[1], weight.granularity,
                                      x2.device, lambda cfg: launch(x2, weight, y, cfg),
                                      kernel=KERNEL)
    return launch(x2, weight, y, config)


__all__ = ["KERNEL", "launch", "plan", "stream_k_mm"]
