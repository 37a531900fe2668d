"""What the GPU benches share: CUDA-event timing, side-by-side contenders alternated over rounds
(median and spread, with the GPU's clocks and temperature beside them), a kernel profile table,
printing/saving results.

Benches run as scripts (``python bench/x.py``), so their folder is on ``sys.path`` and they
``from common import ...``.
"""

from __future__ import annotations

import json
import subprocess

import torch


def timed(fn, warmup: int = 2, iters: int = 5) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs after ``warmup`` runs (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def gpu_state() -> dict:
    """The GPU's SM / memory clocks (MHz), temperature (C) and power (W) now, from nvidia-smi
    (empty where it is missing): a slow round next to a low clock or a hot GPU is the GPU's."""
    fields = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw")
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                               "--format=csv,noheader,nounits", "-i", "0"], capture_output=True,
                              text=True, timeout=10).stdout.strip().splitlines()[0]
        return {k: float(v) for k, v in zip(fields, line.split(", "))}
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        return {}


def alternate(contenders: dict, rounds: int = 3, warmup: int = 2, iters: int = 5) -> dict:
    """Time each ``name -> fn`` side by side, order-robust: ``rounds`` rounds, each timing every
    contender once (median of ``iters`` after ``warmup``), the order rotated every round so no
    contender always runs first (after a cooler GPU) or last. Returns per contender the median over
    rounds, the spread ``(max - min) / median``, the rounds' times, and the GPU state after each
    round."""
    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    states = []
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            times[name].append(timed(contenders[name], warmup=warmup, iters=iters))
        states.append(gpu_state())
    out = {}
    for name, ts in times.items():
        med = sorted(ts)[len(ts) // 2]
        out[name] = {"median_s": med, "spread": (max(ts) - min(ts)) / med, "rounds_s": ts}
    out["gpu_state_per_round"] = states
    return out


def peak_gib(fn) -> float:
    """Peak CUDA memory allocated (GiB) during one call of ``fn``."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def kernel_table(fn, path: str, rows: int = 45) -> None:
    """Profile one call of ``fn`` (after one warm call): ops by CUDA self time, to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows,
                                          max_name_column_width=100))


def report(results: dict, out: str | None) -> None:
    """Print ``results`` as JSON and, with ``out``, write them there."""
    print(json.dumps(results, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
