"""What the GPU benches share: CUDA-event timing, a kernel profile table, printing/saving results.

Benches run as scripts (``python bench/x.py``), so their folder is on ``sys.path`` and they
``from common import ...``.
"""

from __future__ import annotations

import json

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
