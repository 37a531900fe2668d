"""Where a decode step's time goes, kernel by kernel, in the replayed CUDA graph (CUDA only).

    python bench/decode_timeline.py [--shape 8b] [--batch 64] [--steps 4]
                                    [--decode-kernels bf16 tma tma+pf0]

One model (bench/common.py's Llama shape, random bf16 weights), one ``ContinuousEngine`` per
contender (``bf16``, or an FP8 decode kernel with ``bench/fp8_decode.py``'s ``+flags``), each
after its graph is captured: ``--steps`` consecutive ``engine.step()`` calls under
``torch.profiler`` (CUDA activity: the graph's kernels with their start and end). Kernels of one
stream run in order, but with programmatic dependent launch a kernel starts (and waits) before
the one ahead of it ends, so its duration says little. What a kernel costs the step is its
**marginal time**: its end minus the latest end before it (0 for one that ends first). The
marginal times and the idle time add up to the span. Printed per contender, one JSON line: the
span a step (first start to last end over the steps, divided by them), the idle time, and per
kernel (name and grid) its calls a step and marginal us a step, largest first; the time no
kernel ran (the host's) apart, and (``idle_before``) per kernel the idle time a step just before
it starts, largest first: the host's time between graph replays falls before a step's first
kernel, a gap inside the graph before the kernel that waited for it.

Why not ``decode_profile.py``: that one profiles the eager step (no graph, no dependent launch),
where the launches, not the kernels, set the pace.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_random_llama  # noqa: E402
from fp8_decode import SHAPES, _engine, _fp8_on, _selector  # noqa: E402


def _kernels(prof) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kern = [e for e in events if e.get("cat") == "kernel"]
    return sorted(kern, key=lambda e: e["ts"])


def _label(event: dict) -> str:
    grid = event.get("args", {}).get("grid")
    return f"{event['name'][:60]} {tuple(grid) if grid else ''}".strip()


def timeline(kernels: list[dict], steps: int) -> dict:
    """``steps`` engine steps' kernels (in start order) -> the span a step (first start to last
    end over ``steps``), the idle time a step (no kernel running: the host's) and the marginal
    busy time a step per kernel label (see the module docstring)."""
    marginal, calls = collections.defaultdict(float), collections.Counter()
    idle_before = collections.defaultdict(float)
    latest = kernels[0]["ts"]
    for e in kernels:
        end = e["ts"] + e["dur"]
        idle_before[_label(e)] += max(0.0, e["ts"] - latest)
        marginal[_label(e)] += max(0.0, end - max(latest, e["ts"]))
        calls[_label(e)] += 1
        latest = max(latest, end)
    rows = sorted(marginal.items(), key=lambda kv: -kv[1])
    return {"steps": steps, "span_us": round((latest - kernels[0]["ts"]) / steps, 1),
            "idle_us": round(sum(idle_before.values()) / steps, 1),
            "kernels": [{"kernel": k, "calls": calls[k] / steps,
                         "marginal_us": round(v / steps, 1)} for k, v in rows],
            "idle_before": [{"kernel": k, "idle_us": round(v / steps, 1)}
                            for k, v in sorted(idle_before.items(), key=lambda kv: -kv[1])
                            if v > 0]}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8b", choices=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--scales", choices=("block", "channel"), default="channel")
    ap.add_argument("--decode-kernels", nargs="+", default=["bf16", "tma"])
    ap.add_argument("--top", type=int, default=25, help="kernels listed per contender")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_timeline.py: needs a CUDA GPU (it profiles graph replays)")

    import parallel_models as pm
    from parallel_models.inference.fp8 import Fp8Linears

    pm.init_parallel()
    spec = SHAPES[args.shape]
    model = build_random_llama(argparse.Namespace(**spec), pm.LlamaForCausalLMRmPad, seed=0)
    model.requires_grad_(False)
    fp8 = Fp8Linears(model, args.scales, active=False)
    select, out = _selector(), []
    with torch.no_grad():
        for contender in args.decode_kernels:  # ("bf16": the defaults, FP8 off)
            select(contender)
            with _fp8_on(fp8, contender):
                eng = _engine(model, args.batch, args.prompt, 8 + 4 * args.steps,
                              spec["vocab"], args.batch)
                for _ in range(3):
                    eng.step()
                torch.cuda.synchronize()
                with torch.profiler.profile(
                        activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.steps):
                        eng.step()
                    torch.cuda.synchronize()
            row = {"shape": args.shape, "batch": args.batch, "contender": contender,
                   "device": torch.cuda.get_device_name(), **timeline(_kernels(prof), args.steps)}
            row["kernels"] = row["kernels"][:args.top]
            row["idle_before"] = row["idle_before"][:args.top]
            print(json.dumps(row), flush=True)
            out.append(row)
            del eng
            torch.cuda.empty_cache()
        select(None)
    return out


if __name__ == "__main__":
    main()
