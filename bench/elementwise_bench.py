"""The memory-bound elementwise ops of a training step at the Llama-3-8B shape: SwiGLU, RMSNorm
and residual-add RMSNorm, forward and forward+backward, the compiled path (``torch.compile``,
``PARALLEL_MODELS_TRITON_ELEMENTWISE=0``) vs the Triton kernels (llama/layers/elementwise_triton).

    python bench/elementwise_bench.py [--tokens 4096 --hidden 4096 --intermediate 14336]
        [--sweep] [--out elementwise.json]

Per op and contender, for the forward and for forward+backward (``torch.autograd.grad`` of
every input, as training needs; the backward as their difference): ``kernel_ms``, the GPU time of
the kernels (``common.kernel_seconds``: what the GPU-bound training step pays), and ``ms``, the
wall time between CUDA events (``common.timed``, which also holds the host's launch overhead
where the kernels are shorter); medians over rounds that alternate the contenders. From the
kernel time: GB/s of the phase's byte floor (every tensor read or written once: SwiGLU forward
3 x T x I elements, backward 5; RMSNorm 2 and 3; the residual-add one 4 and 4) and the time over
the floor's time at the datasheet bandwidth (``--peak-gbs``, H100 SXM 3350) and at the measured
read bandwidth (``common.hbm_read_bandwidth``). ``step_ms``: the ops' fwd+bwd kernel times in
one 8B training step (``--layers`` SwiGLUs and residual-add norms, layers + 1 plain norms). ``--sweep``: also times the kernels under other
launch configs (``elementwise_triton.LaunchConfig``) and reports the fastest. Under a minute.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from common import hbm_read_bandwidth, kernel_seconds, report, timed

from parallel_models.llama.layers import elementwise_triton as et
from parallel_models.llama.layers import fused_ops


def _cases(args, dev):
    """name -> (fn through fused_ops, inputs, output gradients, (fwd, bwd) floor elements)."""
    t, h, i, eps = args.tokens, args.hidden, args.intermediate, 1e-5
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).bfloat16()

    w = rand(h) + 1
    return {
        "swiglu": (fused_ops.swiglu, [rand(t, 2 * i, scale=3.0)], [rand(t, i)],
                   (3 * t * i, 5 * t * i)),
        "rms_norm": (lambda x, w_: fused_ops.rms_norm(x, w_, eps), [rand(t, h), w], [rand(t, h)],
                     (2 * t * h, 3 * t * h)),
        "add_rms_norm": (lambda x, r, w_: fused_ops.add_rms_norm(x, r, w_, eps),
                         [rand(t, h), rand(t, h), w], [rand(t, h), rand(t, h)],
                         (4 * t * h, 4 * t * h)),
    }


def _phases(fn, inputs, grads):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]

    def fwd():
        fn(*leaves)

    def fwd_bwd():
        outs = fn(*leaves)
        torch.autograd.grad(outs if isinstance(outs, tuple) else (outs,), leaves, grads)

    return fwd, fwd_bwd


def _outputs(fn, inputs, grads):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return list(outs) + list(torch.autograd.grad(outs, leaves, grads))


def _time_case(fn, inputs, grads, kernels: bool, iters: int, wall: bool = True) -> dict:
    """Seconds: ``{fwd,fwd_bwd}_kernel_s`` (GPU kernel time) and, with ``wall``,
    ``{fwd,fwd_bwd}_s`` (CUDA events)."""
    et.set_enabled(kernels)
    try:
        out = {}
        for name, phase in zip(("fwd", "fwd_bwd"), _phases(fn, inputs, grads)):
            if wall:
                out[f"{name}_s"] = timed(phase, warmup=3, iters=iters)
            out[f"{name}_kernel_s"] = kernel_seconds(phase, iters)
        return out
    finally:
        et.set_enabled(None)


def _describe(times: dict, floors: tuple, peak: float, hbm: float) -> dict:
    out = {}
    for phase, elements in (("fwd", floors[0]), ("bwd", floors[1]),
                            ("fwd_bwd", floors[0] + floors[1])):
        if phase == "bwd":
            wall = times["fwd_bwd_s"] - times["fwd_s"]
            kernel = times["fwd_bwd_kernel_s"] - times["fwd_kernel_s"]
        else:
            wall, kernel = times[f"{phase}_s"], times[f"{phase}_kernel_s"]
        floor_bytes = 2 * elements  # bf16
        out[phase] = {"kernel_ms": kernel * 1e3, "ms": wall * 1e3,
                      "gb_s": floor_bytes / kernel / 1e9,
                      "x_floor_datasheet": kernel * peak / floor_bytes,
                      "x_floor_measured_read": kernel * hbm / floor_bytes}
    return out


def _sweep(cases: dict, iters: int) -> dict:
    """fwd+bwd kernel ms of the kernels per launch config (one field changed at a time from the
    default, then the best of each field combined)."""
    base = et.launch_config()  # the options' launch config (elementwise_launch)
    grid = {"swiglu": {"swiglu_block": [512, 1024, 2048, 4096], "swiglu_warps": [2, 4, 8]},
            "rms_norm": {"norm_tile": [2048, 4096, 8192, 16384],
                         "norm_programs_per_sm": [1, 2, 3, 4, 8]}}
    grid["add_rms_norm"] = grid["rms_norm"]
    out = {}
    try:
        for name, fields in grid.items():
            fn, inputs, grads, _ = cases[name]
            rows, best = [], {}
            for field, values in fields.items():
                scores = {}
                for v in values:
                    et.CONFIG = dataclasses.replace(base, **{field: v})
                    scores[v] = _time_case(fn, inputs, grads, True, iters,
                                           wall=False)["fwd_bwd_kernel_s"] * 1e3
                    rows.append({field: v, "fwd_bwd_kernel_ms": scores[v]})
                best[field] = min(scores, key=scores.get)
            et.CONFIG = dataclasses.replace(base, **best)
            combined = _time_case(fn, inputs, grads, True, iters,
                                  wall=False)["fwd_bwd_kernel_s"] * 1e3
            out[name] = {"default": dataclasses.asdict(base), "tried": rows,
                         "best": best, "best_fwd_bwd_kernel_ms": combined}
    finally:
        et.CONFIG = None  # back to the options'
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--layers", type=int, default=32, help="for step_ms")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peak-gbs", type=float, default=3350.0, help="datasheet HBM bandwidth")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    assert et.available(), "triton kernels do not load"
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "shape": {"tokens": args.tokens, "hidden": args.hidden,
                     "intermediate": args.intermediate},
           "launch_config": dataclasses.asdict(et.launch_config())}
    hbm = hbm_read_bandwidth(dev)
    res["hbm_read_gb_s"] = hbm / 1e9
    cases = _cases(args, dev)
    contenders = {"compiled": False, "triton": True}
    for name, (fn, inputs, grads, floors) in cases.items():
        got = {}
        for kernels in (True, False):  # the kernels against the compiled path, every output
            et.set_enabled(kernels)
            try:
                got[kernels] = _outputs(fn, inputs, grads)
            finally:
                et.set_enabled(None)
        rel = max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                  for a, b in zip(got[True], got[False]))
        rounds = {c: [] for c in contenders}
        for r in range(args.rounds):
            order = list(contenders) if r % 2 == 0 else list(contenders)[::-1]
            for c in order:
                rounds[c].append(_time_case(fn, inputs, grads, contenders[c], args.iters))
        entry = {"max_rel_diff_triton_vs_compiled": rel}
        for c, ts in rounds.items():
            med = {k: sorted(t[k] for t in ts)[len(ts) // 2] for k in ts[0]}
            entry[c] = _describe(med, floors, args.peak_gbs * 1e9, hbm)
        entry["speedup_fwd_bwd"] = (entry["compiled"]["fwd_bwd"]["kernel_ms"]
                                    / entry["triton"]["fwd_bwd"]["kernel_ms"])
        res[name] = entry
        for phase in ("fwd", "bwd"):
            c, t = entry["compiled"][phase], entry["triton"][phase]
            print(f"{name} {phase}: kernels compiled {c['kernel_ms']:.4f} ms (x floor "
                  f"{c['x_floor_datasheet']:.2f}), triton {t['kernel_ms']:.4f} ms (x floor "
                  f"{t['x_floor_datasheet']:.2f}, {t['gb_s']:.0f} GB/s); wall fwd+bwd "
                  f"{entry['compiled']['fwd_bwd']['ms']:.3f} vs "
                  f"{entry['triton']['fwd_bwd']['ms']:.3f} ms")
        print(f"{name}: outputs rel diff triton vs compiled {rel:.1e}")
    counts = {"swiglu": args.layers, "add_rms_norm": args.layers, "rms_norm": args.layers + 1}
    step = {c: sum(res[n][c]["fwd_bwd"]["kernel_ms"] * k for n, k in counts.items())
            for c in contenders}
    step["saving_ms"] = step["compiled"] - step["triton"]
    res["step_ms"] = step
    print(f"one {args.layers}-layer step, these ops' kernels: compiled {step['compiled']:.2f} "
          f"ms, triton {step['triton']:.2f} ms, saving {step['saving_ms']:.2f} ms")
    if args.sweep:
        res["sweep"] = _sweep(cases, args.iters)
        for name, found in res["sweep"].items():
            print(f"sweep {name}: best {found['best']} {found['best_fwd_bwd_kernel_ms']:.4f} ms "
                  f"fwd+bwd kernels (default {res[name]['triton']['fwd_bwd']['kernel_ms']:.4f})")
    report(res, args.out)


if __name__ == "__main__":
    main()
