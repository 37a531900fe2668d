"""The FP8 decode step's RMSNorm + e4m3 copy kernel (``producer_kernels._rms_norm_quant_kernel``,
65 launches a step of the 8B shape, about 3 us each) at each warp count, back to back in a CUDA
graph with dependent launch on, as the rollout runs it.

    python bench/fp8_norm_probe.py [--rows 64] [--hidden 4096] [--warps 4 8 16] [--launches 65]
    python bench/fp8_norm_probe.py --tiny      # CPU smoke (Triton's interpreter, no graph)

One JSON line per warp count: ``us`` a launch (the median of ``--replays`` replays) and
``max_abs_diff`` of its outputs against the default warps' (the same arithmetic: 0).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_gemm_graph_probe import _timed, probe_parser  # noqa: E402


def main(argv=None) -> int:
    ap = probe_parser(__doc__)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--launches", type=int, default=65)
    args = ap.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.rows, args.hidden, args.launches, args.replays, args.warps = 4, 256, 2, 1, [4, 8]
    import triton

    from parallel_models.inference.fp8 import producer_kernels
    from parallel_models.inference.fp8.dependent_launch import launch_options
    from parallel_models.inference.fp8.quantize import E4M3, E4M3_MAX

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    rows, n = args.rows, args.hidden
    x, r = (torch.randn(rows, n, device=device, dtype=dtype, generator=gen) for _ in range(2))
    w = torch.rand(n, device=device, dtype=dtype, generator=gen) + 0.5
    block = triton.next_power_of_2(n)
    reference = None
    for warps in args.warps:
        outs = [(torch.empty_like(x), torch.empty_like(x),
                 torch.empty(rows, n, dtype=E4M3, device=device),
                 torch.empty(rows, dtype=torch.float32, device=device))
                for _ in range(args.launches)]

        def launch(t, y, q, s, warps=warps):
            producer_kernels._rms_norm_quant_kernel[(rows,)](
                x, r, t, w, y, q, s, n, x.stride(0), r.stride(0), t.stride(0), y.stride(0),
                q.stride(0), 1e-5, HAS_RESIDUAL=True, BLOCK=block, FP8_MAX=E4M3_MAX,
                EMULATE=producer_kernels._INTERPRETED, num_warps=warps,
                **launch_options(device))

        us = _timed([lambda o=o: launch(*o) for o in outs], args.replays, device)
        got = torch.cat([outs[0][1].float(), outs[0][2].float(), outs[0][3][:, None]], dim=1)
        reference = got if reference is None else reference
        row = {"what": "rms_norm_quant", "rows": rows, "hidden": n, "warps": warps,
               "us": round(us, 3), "max_abs_diff": float((got - reference).abs().max())}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
