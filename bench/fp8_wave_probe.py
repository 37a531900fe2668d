"""Whether the decode GEMMs are bound by how many SMs stream weights: a plain read of the 8B
gate_up's e4m3 bytes by a fixed number of programs, and the fused gate_up + SwiGLU kernel
(``swiglu_gemm_kernel``) at its tuned tiles with as many programs as the GPU has SMs, fewer
(the 8B shape: 112 for 132 SMs) and one more, all back to back in a CUDA graph.

    python bench/fp8_wave_probe.py [--programs 112 120 128 132 133 132x27] [--stages 4 5]
                                   [--grids 112 132 264] [--layers 16] [--replays 10]
                                   [--out probe.json]
    python bench/fp8_wave_probe.py --tiny      # CPU smoke (Triton's interpreter, no graph)

If a program streams at a fixed rate, the fused kernel takes the same time from 112 to 132
programs (more features in the same time) and a stream-K split of the 8B gate_up over every SM
would gain ``132 / 112``; if the GPU's bandwidth is the bound, its time grows with the bytes.
``PxS`` runs P programs over ``S`` K steps of 128 inputs (default: the hidden size's 32):
``132x27`` streams the 8B gate_up's bytes (within 0.6 %) over every SM of an H100, what a
stream-K split's main loops would do, without its partial sums' hand-over. ``--stages``: each
shape at these pipeline depths too (the tuned config's depth first).
One JSON line per timing: ``what`` (``read``: ``programs`` programs each taking the max of an equal
contiguous share of the bytes; ``tma_swiglu``: ``programs`` 128-feature programs, the
intermediate size ``programs x 128``), ``us`` a launch, ``tbps`` (the weight's bytes over it)
and ``gbps_per_program``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import save  # noqa: E402
from fp8_gemm_graph_probe import _timed, probe_parser  # noqa: E402

HIDDEN, FEATURES = 4096, 128  # the 8B hidden size; the fused kernel's features a program


def _chunk_read():
    import triton
    import triton.language as tl

    @triton.jit
    def read_share(W, OUT, n, share, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * share
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for off in range(0, share, BLOCK):
            offs = start + off + tl.arange(0, BLOCK)
            acc = tl.maximum(acc, tl.load(W + offs, other=0,
                                          mask=(offs < n) & (off + tl.arange(0, BLOCK) < share)))
        tl.store(OUT + pid, tl.max(acc, axis=0))  # (a max: no int32 overflow in the interpreter)

    def read(w: torch.Tensor, out: torch.Tensor, programs: int, block: int) -> None:
        words = w.view(torch.int32).view(-1)
        share = -(-words.numel() // programs)
        read_share[(programs,)](words, out, words.numel(), share, BLOCK=block)

    return read


def main(argv=None) -> int:
    ap = probe_parser(__doc__)
    ap.add_argument("--programs", nargs="+", default=["112", "120", "128", "132", "133", "132x27"])
    ap.add_argument("--stages", type=int, nargs="+", default=[])
    ap.add_argument("--grids", type=int, nargs="+", default=[112, 128, 132, 264])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    hidden, features, block = HIDDEN, FEATURES, 2048
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.layers, args.replays, args.rows = 2, 1, 16
        args.programs, args.grids, hidden, block = ["2", "3x1"], [2, 3], 256, 64
    from parallel_models.inference.fp8 import decode_tuning, swiglu_gemm_kernel
    from parallel_models.inference.fp8.quantize import (E4M3, QUANTIZED_COPY, quantize_activation,
                                                        quantize_weight)

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.rows, hidden, device=device, dtype=dtype, generator=gen)
    shapes = [(int(p.split("x")[0]), int(p.split("x")[1]) * 128 if "x" in p else hidden)
              for p in args.programs]
    candidates = decode_tuning.candidates(args.rows, 2 * features * shapes[0][0], hidden,
                                          "channel", smem=decode_tuning.smem_bytes(device),
                                          kernel="tma_swiglu")
    cfg = next(c for c in candidates if c.block_n == features and c.block_k == 128
               and c.tokens_first == (args.rows == 64))
    results = []

    def emit(what: str, programs: int, us: float, weight_bytes: int, **extra) -> None:
        row = {"what": what, "programs": programs, **extra, "us": round(us, 3),
               "tbps": round(weight_bytes / us / 1e6, 3),
               "gbps_per_program": round(weight_bytes / us / 1e3 / programs, 2)}
        results.append(row)
        print(json.dumps(row), flush=True)

    for index, (programs, k) in enumerate(shapes):
        inter = programs * features
        weights = [quantize_weight(torch.randn(2 * inter, k, device=device, dtype=dtype,
                                               generator=gen) * 0.02, "channel")
                   for _ in range(args.layers)]
        xk = x[:, :k].contiguous()
        copy = quantize_activation(xk, "channel")
        setattr(xk, QUANTIZED_COPY, (copy[0].to(E4M3), copy[1]))
        if index == 0:  # the read: the smallest weight, by each grid
            sums = torch.empty(max(args.grids), dtype=torch.int32, device=device)
            read = _chunk_read()
            for grid in args.grids:
                us = _timed([lambda w=w, g=grid: read(w.data, sums, g, block) for w in weights],
                            args.replays, device)
                emit("read", grid, us, weights[0].data.numel())
        h = torch.empty(args.rows, inter, dtype=dtype, device=device)
        hq = (torch.empty(args.rows, inter, dtype=E4M3, device=device),
              torch.empty(args.rows, inter // 64, dtype=torch.float32, device=device))
        for stages in [cfg.num_stages] + [s for s in args.stages if s != cfg.num_stages]:
            tiles = dataclasses.replace(cfg, num_stages=stages)
            try:
                us = _timed([lambda w=w: swiglu_gemm_kernel.launch(xk, w, h, tiles, hq)
                             for w in weights], args.replays, device)
            except Exception as e:  # (a depth that does not fit the shared memory)
                print(json.dumps({"programs": programs, "k": k, "stages": stages,
                                  "error": f"{type(e).__name__}: {str(e)[:200]}"}), flush=True)
                continue
            emit("tma_swiglu", programs, us, weights[0].data.numel(), k=k,
                 tiles=tiles.as_dict())
        del weights
    save(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
