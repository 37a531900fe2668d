"""Launches each FP8 decode GEMM once (8B linears, 64 rows) between ``cudaProfilerStart`` and
``Stop``, for Nsight Compute to read the hardware counters of (where the time goes: HBM and L2
throughput, occupancy, warp stalls); nothing is timed here.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        python bench/fp8_kernel_profile.py [--linears gate_up qkv] [--scales channel]
    bash bench/gpu_session.sh fp8prof     # that, and the 8B decode step by category

Per linear, in order: bf16 ``F.linear`` (cuBLAS), ``torch._scaled_mm`` row-wise, then each
``--kernels`` entry with its ``--configs`` (``decode_tuning.DecodeConfig`` fields as JSON, one per
kernel; default: the kernel's default config) after one untimed launch that compiles it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import LLAMA3_8B  # noqa: E402
from fp8_gemm_sweep import KERNEL_PARTS, _scaled_mm_rowwise, _weights, linears  # noqa: E402


def main(argv=None) -> None:
    from parallel_models.inference.fp8 import decode_tuning
    from parallel_models.inference.fp8.quantize import quantize_weight

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--linears", nargs="+", default=["gate_up", "qkv"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--scales", default="channel", choices=("block", "channel"))
    ap.add_argument("--kernels", nargs="+", default=["weight_only", "w8a8"],
                    choices=list(KERNEL_PARTS))
    ap.add_argument("--configs", nargs="*", default=[],
                    help="kernel=JSON of DecodeConfig fields, e.g. weight_only='{...}'")
    args = ap.parse_args(argv)
    configs = {k: decode_tuning.DecodeConfig(**json.loads(v))
               for k, v in (c.split("=", 1) for c in args.configs)}
    dev = torch.device("cuda")
    plan = linears(LLAMA3_8B)
    for name in args.linears:
        out, inp = plan[name]
        gen = torch.Generator(device=dev).manual_seed(out)
        w, q = _weights(out, inp, dev, args.scales, gen)
        x = torch.randn(args.rows, inp, device=dev, generator=gen).bfloat16()
        y = torch.empty(args.rows, out, dtype=torch.bfloat16, device=dev)
        runs = [("bf16", lambda: torch.nn.functional.linear(x, w)),
                ("scaled_mm", _scaled_mm_rowwise(x, quantize_weight(w, "channel")))]
        for kernel in args.kernels:
            module, launch_name = KERNEL_PARTS[kernel][:2]
            launch = getattr(importlib.import_module(f"parallel_models.inference.fp8.{module}"),
                             launch_name)
            cfg = configs.get(kernel) or decode_tuning.default_config(
                args.rows, out, inp, args.scales, decode_tuning.sm_count(dev),
                decode_tuning.smem_bytes(dev), kernel=kernel)
            runs.append((f"{kernel} {cfg}", lambda launch=launch, cfg=cfg: launch(x, q, y, cfg)))
        for _, fn in runs:  # compile, warm cuBLAS
            fn()
        torch.cuda.synchronize()
        for label, fn in runs:
            print(f"{name} {out}x{inp} rows {args.rows}: {label}", flush=True)
            torch.cuda.profiler.start()
            fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
