"""What the down GEMM's group-scaled input costs, and two ways to cut it: the 8B MLP's down GEMM
(4096 x 14336, 64 decode rows) reads the e4m3 copy the fused gate_up + SwiGLU kernel leaves,
with a scale per token and 128 inputs, so ``tma_decode_kernel`` runs a dot per group and adds
it to the accumulator times the group's scales. In a graph of back-to-back launches
(bench/fp8_gemm_graph_probe.py, session 23) that took 28.8 us against 26.5 us for the same
GEMM on a per-token copy. Here, tokens-first tiles only, side by side in one graph each:

- ``token``: ``tma_decode_kernel.launch`` on a per-token copy (the floor);
- ``group``: ``tma_decode_kernel.launch`` on the group-scaled copy (today's path);
- ``exp[...]``: this file's kernel on the group-scaled copy, a K step per group, with
  ``defer`` (the group's product added one step later, so the tensor cores have the next
  group's dot in flight while the scale multiply waits) and / or ``coalesced`` (the scales
  stored group-major, ``[groups, rows]``, so a group's 64 scales are one 256-byte read instead
  of 64 strided ones).

    python bench/fp8_group_scale_probe.py [--layers 16] [--replays 10]
    python bench/fp8_group_scale_probe.py --tiny      # CPU smoke (Triton's interpreter)

One JSON line per (variant, tiles): ``us`` a launch (the median replay over the launches) and
``max_abs_diff`` against ``group`` with the same tiles (its results are expected bit-equal).
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

from fp8_stream_probe import tile_start  # noqa: E402  (its kernels' start)

from parallel_models.inference.fp8.decode_gemm_shared import finish_tile  # noqa: E402
from parallel_models.inference.fp8.tma_decode_kernel import part_dot  # noqa: E402

GROUP = 128


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def group_kernel(x_desc, w_desc, W, XS, S, Y, P, C, M, N, K, stride_w, stride_xm, stride_xg,
                 stride_ym, ws_rows, SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr,
                 LINES: tl.constexpr, DEFER: tl.constexpr):
    pid_m, pid_k, pid_n, num_m, k_begin, k_end, rn, rm = tile_start(
        W, M, N, K, SPLIT_K, stride_w, BLOCK_M, BLOCK_N, GROUP, PDL, LINES)
    n_ok, m_ok = rn < N, rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part_prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    scale_prev = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(k_begin, k_end, GROUP):
        w = w_desc.load([pid_n * BLOCK_N, k])
        x = x_desc.load([pid_m * BLOCK_M, k])
        scale = tl.load(XS + rm.to(tl.int64) * stride_xm + (k // GROUP) * stride_xg,
                        mask=m_ok, other=0.0)
        part = part_dot(x, w, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), GROUP,
                        EMULATE)
        if DEFER:
            acc = acc + part_prev * scale_prev[:, None]
            part_prev = part
            scale_prev = scale
        else:
            acc = acc + part * scale[:, None]
    if DEFER:
        acc = acc + part_prev * scale_prev[:, None]
    finish_tile(acc, Y, S, P, C, rm, rn, n_ok, m_ok, pid_m, pid_k, pid_n, num_m, N, ws_rows,
                stride_ym, SPLIT_K, False, BLOCK_N, BLOCK_M, True)


def _launcher(q, scales, weight, y, cfg, defer: bool):
    """A closure launching this file's kernel: ``scales`` ``[rows, groups]`` (any strides)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from parallel_models.inference.fp8 import decode_gemm_shared as shared
    from parallel_models.inference.fp8.dependent_launch import launch_options, prefetch_lines

    kernel = group_kernel
    rows, inp = q.shape
    out = weight.shape[0]
    x_desc = TensorDescriptor(q, [rows, inp], [q.stride(0), 1], [cfg.block_m, GROUP])
    w_desc = TensorDescriptor(weight.data, [out, inp], [weight.data.stride(0), 1],
                              [cfg.block_n, GROUP])
    if cfg.split_k > 1:
        partials, counters = shared.workspace(q.device, cfg.split_k, rows, out)
        ws_rows = partials.shape[1]
    else:
        partials, counters = shared.unused_pointers(q.device)
        ws_rows = 0
    k_span = -(-inp // (GROUP * cfg.split_k)) * GROUP
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"

    def run():
        kernel[(cfg.grid(rows, out),)](
            x_desc, w_desc, weight.data, scales, weight.scale, y, partials, counters, rows, out,
            inp, weight.data.stride(0), scales.stride(0), scales.stride(1), y.stride(0),
            ws_rows, cfg.split_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP=GROUP,
            EMULATE=interpreted, LINES=prefetch_lines(q.device, cfg.block_n, k_span),
            DEFER=defer, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **launch_options(q.device))
    return run


def main(argv=None) -> int:
    from fp8_gemm_graph_probe import probe_parser

    args = probe_parser(__doc__).parse_args(argv)
    from fp8_gemm_graph_probe import _timed

    from parallel_models.inference.fp8 import tma_decode_kernel
    from parallel_models.inference.fp8.decode_tuning import DecodeConfig
    from parallel_models.inference.fp8.quantize import (E4M3, QUANTIZED_COPY, quantize_activation,
                                                        quantize_weight)

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    graph = device.type == "cuda"
    out, inp, rows, layers = (4096, 14336, 64, args.layers) if not args.tiny else (64, 512, 16, 2)
    dtype = torch.bfloat16 if graph else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [quantize_weight(torch.randn(out, inp, device=device, dtype=dtype, generator=gen)
                               * 0.02, "channel") for _ in range(layers)]
    x = torch.randn(rows, inp, device=device, dtype=dtype, generator=gen)
    gq, gs = quantize_activation(x, "block", group=GROUP)
    tq, ts = quantize_activation(x, "channel")
    x_group, x_token = x.clone(), x.clone()
    setattr(x_group, QUANTIZED_COPY, (gq.to(E4M3), gs))
    setattr(x_token, QUANTIZED_COPY, (tq.to(E4M3), ts))
    gs_coalesced = gs.t().contiguous().t()  # (group-major storage, the same [rows, groups] view)
    tiles = [(32, 2, 8), (32, 2, 4), (16, 1, 8), (16, 2, 8), (32, 1, 8)] if graph else \
        [(16, 1, 2), (16, 2, 2)]
    for block_n, split, stages in tiles:
        cfg = DecodeConfig(block_n, rows if not graph else 64, GROUP, split, 4, stages, True)
        outs = {}
        variants = {"token": (x_token, None), "group": (x_group, None),
                    "exp": (gs, False), "exp_defer": (gs, True),
                    "exp_coalesced": (gs_coalesced, False),
                    "exp_defer_coalesced": (gs_coalesced, True)}
        for name, (source, defer) in variants.items():
            ys = [torch.empty(rows, out, dtype=dtype, device=device) for _ in weights]
            if defer is None:
                launches = [lambda w=w, y=y, s=source: tma_decode_kernel.launch(s, w, y, cfg)
                            for w, y in zip(weights, ys)]
            else:
                launches = [_launcher(gq.to(E4M3), source, w, y, cfg, defer)
                            for w, y in zip(weights, ys)]
            try:
                us = _timed(launches, args.replays, device)
            except Exception as e:
                print(json.dumps({"variant": name, "tiles": cfg.as_dict(),
                                  "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
                continue
            outs[name] = ys[0].float()
            diff = (outs[name] - outs["group"]).abs().max().item() if "group" in outs else None
            print(json.dumps({"variant": name, "tiles": cfg.as_dict(), "us": round(us, 3),
                              "max_abs_diff_vs_group": diff}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
