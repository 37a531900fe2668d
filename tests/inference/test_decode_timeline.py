"""``bench/decode_timeline.py``'s accounting (the GPU run needs CUDA): a kernel's marginal time is
its end minus the latest end before it, the time no kernel runs is idle, and the two add up to
the span; kernels are told apart by name and grid; each idle gap is put to the kernel that
starts after it."""

import os
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)

from decode_timeline import timeline  # noqa: E402


def _k(name, ts, dur, grid=(1, 1, 1)):
    return {"name": name, "ts": ts, "dur": dur, "args": {"grid": list(grid)}}


def test_marginal_times_and_idle_add_up_to_the_span():
    kernels = [_k("gemm", 0, 10, (48, 1, 1)),
               _k("norm", 5, 10),                # launched early (dependent launch): 5 us its own
               _k("gemm", 20, 5, (128, 1, 1)),   # after 5 us idle (the host)
               _k("norm", 24, 2),                # ends 1 us after the one before it
               _k("gemm", 24.5, 1, (48, 1, 1))]  # ends before the latest end: costs nothing
    got = timeline(kernels, steps=1)
    assert got["span_us"] == 26.0 and got["idle_us"] == 5.0
    marginal = {k["kernel"]: (k["marginal_us"], k["calls"]) for k in got["kernels"]}
    assert marginal == {"gemm (48, 1, 1)": (10.0, 2), "norm (1, 1, 1)": (6.0, 2),
                        "gemm (128, 1, 1)": (5.0, 1)}
    assert sum(m for m, _ in marginal.values()) + got["idle_us"] == got["span_us"]
    assert got["kernels"][0]["kernel"] == "gemm (48, 1, 1)"  # (largest first)
    assert got["idle_before"] == [{"kernel": "gemm (128, 1, 1)", "idle_us": 5.0}]


def test_per_step_figures_divide_by_the_steps():
    got = timeline([_k("a", 0, 4), _k("a", 4, 4)], steps=2)
    assert got["span_us"] == 4.0 and got["kernels"][0] == {"kernel": "a (1, 1, 1)",
                                                           "calls": 1.0, "marginal_us": 4.0}
