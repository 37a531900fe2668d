"""Where the FP8 decode GEMMs lose bandwidth against a plain read of their weights: the 8B linears
at 64 rows, back to back in a CUDA graph (bench/fp8_gemm_graph_probe.py's timing), each as

- ``read``: a Triton kernel summing the e4m3 weight's bytes, 64 KiB a program (contiguous);
- ``tiles``: the GEMM's program grid and weight tiles (TMA boxes of ``block_n`` rows x
  ``block_k`` inputs, K in order), summed instead of multiplied: the GEMM's access pattern
  without its activations or MMA;
- ``tiles+x``: the same, with the activation tile each K step loaded and summed too (every
  program reads the same ``[64, block_k]`` columns at about the same time);
- ``gemm``: this file's tokens-first GEMM (``tma_decode_kernel``'s per-token recipe, the same
  tiles); ``gemm+rot``: each program starts its K loop at its own offset (strip number times
  a K step, wrapping), so the programs read different activation columns at any moment.

    python bench/fp8_stream_probe.py [--layers 16] [--replays 10]
    python bench/fp8_stream_probe.py --tiny      # CPU smoke (Triton's interpreter)

One JSON line per (linear, variant): ``us`` a launch and ``tbps`` (the weight's bytes over it).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--tiny" in sys.argv:  # (before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from parallel_models.inference.fp8.decode_gemm_shared import finish_tile, program_tile  # noqa
from parallel_models.inference.fp8.dependent_launch import (prefetch_weights,  # noqa: E402
                                                            release_dependents, wait_for_inputs)
from parallel_models.inference.fp8.tma_decode_kernel import part_dot  # noqa: E402

# (name, out, in, block_n, block_k, split_k, warps, stages): the tiles the tuner chose (session 23)
LINEARS = [("qkv", 6144, 4096, 32, 128, 1, 4, 8), ("o", 4096, 4096, 16, 256, 1, 4, 5),
           ("gate_up", 28672, 4096, 128, 128, 1, 4, 4), ("down", 4096, 14336, 32, 256, 2, 4, 4)]


@triton.jit
def tiles_kernel(w_desc, x_desc, OUT, M, N, K, SPLIT_K, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WITH_X: tl.constexpr):
    pid_m, pid_k, pid_n, num_m, k_begin, k_end = program_tile(M, K, SPLIT_K, BLOCK_M, BLOCK_K)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        acc += tl.sum(w_desc.load([pid_n * BLOCK_N, k]).to(tl.float32), 0)
        if WITH_X:
            acc += tl.sum(x_desc.load([pid_m * BLOCK_M, k]).to(tl.float32), 0)
    tl.store(OUT + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def tile_start(W, M, N, K, SPLIT_K, stride_w, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, PDL: tl.constexpr, LINES: tl.constexpr):
    """A probe GEMM program's start, as ``tma_decode_kernel``'s: its tile (``program_tile``),
    the weight prefetch, the dependent-launch wait -> (row tile, K split, strip, row tiles,
    first K, end of K, weight rows, activation rows)."""
    pid_m, pid_k, pid_n, num_m, k_begin, k_end = program_tile(M, K, SPLIT_K, BLOCK_M, BLOCK_K)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    prefetch_weights(W, rn, N, stride_w, k_begin, k_end, LINES)
    wait_for_inputs(PDL)
    release_dependents(PDL)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return pid_m, pid_k, pid_n, num_m, k_begin, k_end, rn, rm


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def gemm_kernel(x_desc, w_desc, W, XS, S, Y, P, C, M, N, K, stride_w, stride_ym, ws_rows,
                SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EMULATE: tl.constexpr, PDL: tl.constexpr, LINES: tl.constexpr,
                ROTATE: tl.constexpr):
    pid_m, pid_k, pid_n, num_m, k_begin, k_end, rn, rm = tile_start(
        W, M, N, K, SPLIT_K, stride_w, BLOCK_M, BLOCK_N, BLOCK_K, PDL, LINES)
    n_ok, m_ok = rn < N, rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    steps = tl.cdiv(k_end - k_begin, BLOCK_K)
    shift = (pid_n % steps) if ROTATE else 0
    for i in range(0, steps):
        k = k_begin + ((i + shift) % steps) * BLOCK_K
        w = w_desc.load([pid_n * BLOCK_N, k])
        x = x_desc.load([pid_m * BLOCK_M, k])
        acc = part_dot(x, w, acc, 128, EMULATE)
    acc = acc * tl.load(XS + rm, mask=m_ok, other=0.0)[:, None]
    finish_tile(acc, Y, S, P, C, rm, rn, n_ok, m_ok, pid_m, pid_k, pid_n, num_m, N, ws_rows,
                stride_ym, SPLIT_K, False, BLOCK_N, BLOCK_M, True)


def main(argv=None) -> int:
    from fp8_gemm_graph_probe import probe_parser

    args = probe_parser(__doc__).parse_args(argv)
    from fp8_gemm_graph_probe import _read_kernel, _timed

    from parallel_models.inference.fp8 import decode_gemm_shared as shared
    from parallel_models.inference.fp8 import tma_decode_kernel
    from parallel_models.inference.fp8.decode_tuning import DecodeConfig
    from parallel_models.inference.fp8.dependent_launch import launch_options, prefetch_lines
    from parallel_models.inference.fp8.quantize import (E4M3, QUANTIZED_COPY, quantize_activation,
                                                        quantize_weight)

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    graph = device.type == "cuda"
    dtype = torch.bfloat16 if graph else torch.float32
    rows = 64 if graph else 16
    linears = LINEARS if graph else [("tiny", 64, 512, 16, 128, 2, 4, 2)]
    layers = args.layers if graph else 2
    for name, out, inp, block_n, block_k, split, warps, stages in linears:
        gen = torch.Generator(device=device).manual_seed(0)
        weights = [quantize_weight(torch.randn(out, inp, device=device, dtype=dtype,
                                               generator=gen) * 0.02, "channel")
                   for _ in range(layers)]
        x = torch.randn(rows, inp, device=device, dtype=dtype, generator=gen)
        q, s = quantize_activation(x, "channel")
        q = q.to(E4M3)
        setattr(x, QUANTIZED_COPY, (q, s))
        cfg = DecodeConfig(block_n, 64 if graph else 16, block_k, split, warps, stages, True)
        grid = cfg.grid(rows, out)
        x_desc = TensorDescriptor(q, [rows, inp], [q.stride(0), 1], [cfg.block_m, block_k])
        w_descs = [TensorDescriptor(w.data, [out, inp], [w.data.stride(0), 1],
                                    [block_n, block_k]) for w in weights]
        sums = torch.empty(max(grid, out * inp // 65536 + 1), dtype=torch.float32,
                           device=device)
        ys = [torch.empty(rows, out, dtype=dtype, device=device) for _ in weights]
        if split > 1:
            partials, counters = shared.workspace(device, split, rows, out)
            ws_rows = partials.shape[1]
        else:
            (partials, counters), ws_rows = shared.unused_pointers(device), 0
        k_span = -(-inp // (block_k * split)) * block_k
        lines = prefetch_lines(device, block_n, k_span)
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"

        def tiles(w_desc, with_x):
            return lambda: tiles_kernel[(grid,)](w_desc, x_desc, sums, rows, out, inp, split,
                                                 BLOCK_M=cfg.block_m, BLOCK_N=block_n,
                                                 BLOCK_K=block_k, WITH_X=with_x,
                                                 num_warps=warps, num_stages=stages)

        def gemm(w, w_desc, y, rotate):
            return lambda: gemm_kernel[(grid,)](
                x_desc, w_desc, w.data, s, w.scale, y, partials, counters, rows, out, inp,
                w.data.stride(0), y.stride(0), ws_rows, split, BLOCK_M=cfg.block_m,
                BLOCK_N=block_n, BLOCK_K=block_k, EMULATE=interpreted, LINES=lines,
                ROTATE=rotate, num_warps=warps, num_stages=stages, **launch_options(device))
        read = _read_kernel() if graph else None
        variants = {
            "read": [lambda w=w: read(w.data, sums) for w in weights] if graph else None,
            "tiles": [tiles(d, False) for d in w_descs],
            "tiles+x": [tiles(d, True) for d in w_descs],
            "production": [lambda w=w, y=y: tma_decode_kernel.launch(x, w, y, cfg)
                           for w, y in zip(weights, ys)],
            "gemm": [gemm(w, d, y, False) for w, d, y in zip(weights, w_descs, ys)],
            "gemm+rot": [gemm(w, d, y, True) for w, d, y in zip(weights, w_descs, ys)],
        }
        results = {}
        for variant, launches in variants.items():
            if launches is None:
                continue
            try:
                us = _timed(launches, args.replays, device)
            except Exception as e:  # noqa: BLE001 - reported, the next variant runs
                print(json.dumps({"linear": name, "variant": variant,
                                  "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
                continue
            if variant.startswith(("gemm", "production")):
                results[variant] = ys[0].float().clone()
            diff = (results[variant] - results["production"]).abs().max().item() \
                if variant in results and "production" in results else None
            print(json.dumps({"linear": name, "variant": variant, "us": round(us, 3),
                              "tbps": round(out * inp / us / 1e6, 3),
                              "max_abs_diff_vs_production": diff,
                              "tiles": cfg.as_dict()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
