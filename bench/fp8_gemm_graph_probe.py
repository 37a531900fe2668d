"""The FP8 decode GEMMs back to back in a CUDA graph, one tile config at a time, beside cuBLAS's
bf16 GEMM and a plain HBM read of the same bytes: what each linear's candidates cost in the
steady state a decode step's graph runs them in (dependent launch and the weight prefetch on, as
the rollout has them), rather than one launch timed alone with the L2 flushed
(``decode_tuning``'s tuner, bench/fp8_gemm_sweep.py).

    python bench/fp8_gemm_graph_probe.py [--linears qkv o gate_up down] [--rows 64]
                                         [--layers 16] [--replays 10] [--promote 128 0]
                                         [--candidates I ...] [--out probe.json]
    python bench/fp8_gemm_graph_probe.py --tiny      # CPU smoke (Triton's interpreter, no graph)

Per linear of the 8B shape (qkv 6144x4096, o 4096x4096, gate_up 28672x4096 as the fused gate_up
+ SwiGLU kernel, down 4096x14336): ``--layers`` distinct random weights (channel scales), so
no launch finds its weight in L2, and one activation ``[rows, in]`` with its e4m3 copy made
beforehand (per token; for ``down`` also per token and 128 inputs, the copy the fused SwiGLU
kernel leaves: ``scales`` ``group128``). One graph per (config, scales): ``--layers`` launches,
each into its own output; replayed ``--replays`` times (CUDA events), the median over replays
divided by the launches. One JSON line per timing: ``linear``, ``what`` (``tma`` / ``tma_swiglu``
with ``tiles`` and ``scales``; ``bf16``: ``F.linear`` on a bf16 copy; ``read``: a Triton kernel
summing the e4m3 weight's bytes, 64 KiB a program), ``us`` a launch and ``tbps`` (the weight's
bytes over it: 1 a weight, 2 for ``bf16``). Candidates: ``decode_tuning.candidates`` for the
kernel and shape (``--candidates``: those at these indices). ``--promote``: each config once
per value of ``tma_decode_kernel.PROMOTE_ENV`` (``promote``: inputs the FP8 MMA sums before an
fp32 accumulator takes them, 0 never), with the output's error against float64 arithmetic on
the same e4m3 values and scales (the first weight): ``max_err`` (the largest |difference| over
the largest |exact|) and ``mean_err`` (mean |difference| over mean |exact|).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import graph_us, save  # noqa: E402

LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
           "down": (4096, 14336)}
TINY = {"qkv": (192, 128), "o": (128, 128), "gate_up": (512, 128), "down": (128, 256)}


def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_bytes(W, OUT, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        values = tl.load(W + offs, mask=offs < n, other=0)
        tl.store(OUT + pid, tl.sum(values, axis=0))

    def read(w: torch.Tensor, out: torch.Tensor) -> None:
        words = w.view(torch.int32).view(-1)
        block = 16384
        read_bytes[(triton.cdiv(words.numel(), block),)](words, out, words.numel(), BLOCK=block)

    return read


def probe_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments the decode GEMM probes share: ``--layers``, ``--replays``, ``--tiny``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16, help="distinct weights, one launch each")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run (Triton's interpreter)")
    return ap


def _timed(launches: list, replays: int, device: torch.device) -> float:
    """Microseconds a launch of ``launches`` captured back to back in one CUDA graph, the median
    of ``replays`` replays (``common.graph_us``; the CPU: wall time of one pass)."""
    return graph_us(launches, device, reps=len(launches), replays=replays)


def _exact(name: str, x_q, x_scale, weight) -> torch.Tensor:
    """float64 arithmetic on the e4m3 values and scales a launch reads (each value times its
    scale rounded to fp32 first, as ``quantize``'s dequantizers give them): ``x_q`` times
    ``weight``, for ``gate_up`` then SwiGLU (``[rows, out / 2]``)."""
    from parallel_models.inference.fp8.quantize import dequantize_activation, dequantize_weight

    if x_scale.dim() == 1:  # (per token, else per token and group: the fused SwiGLU's copy)
        x = dequantize_activation(x_q, x_scale, "channel", torch.float64)
    else:
        x = dequantize_activation(x_q, x_scale, "block", torch.float64,
                                  group=x_q.shape[1] // x_scale.shape[1])
    y = x @ dequantize_weight(weight.data, weight.scale, "channel", torch.float64).t()
    if name == "gate_up":
        gate, up = y.chunk(2, dim=1)
        y = gate * torch.sigmoid(gate) * up
    return y


def _errors(got: torch.Tensor, exact: torch.Tensor) -> dict:
    """``max_err`` and ``mean_err`` of ``got`` against ``exact`` (the module docstring)."""
    diff = (got.double() - exact).abs()
    return {"max_err": float(diff.max() / exact.abs().max()),
            "mean_err": float(diff.mean() / exact.abs().mean())}


def probe(name: str, out: int, inp: int, args, device: torch.device) -> list[dict]:
    from parallel_models.inference.fp8 import decode_tuning, swiglu_gemm_kernel, tma_decode_kernel
    from parallel_models.inference.fp8.quantize import (E4M3, QUANTIZED_COPY, quantize_activation,
                                                        quantize_weight)

    graph = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if graph else torch.float32
    bf16 = [torch.randn(out, inp, device=device, dtype=dtype, generator=gen) * 0.02
            for _ in range(args.layers)]
    fp8 = [quantize_weight(w, "channel") for w in bf16]
    x = torch.randn(args.rows, inp, device=device, dtype=dtype, generator=gen)
    weight_bytes = out * inp
    rows = []

    def emit(what: str, us: float, **extra) -> None:
        read = weight_bytes * (2 if what == "bf16" else 1)  # (the bf16 GEMM reads 2 bytes each)
        row = {"linear": name, "shape": [out, inp], "rows": args.rows, "what": what, **extra,
               "us": round(us, 3), "tbps": round(read / us / 1e6, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)

    if graph:
        emit("bf16", _timed([lambda w=w: F.linear(x, w) for w in bf16], args.replays, device))
        sums = torch.empty(weight_bytes // 65536 + 1, dtype=torch.int32, device=device)
        read = _read_kernel()
        emit("read", _timed([lambda w=w: read(w.data, sums) for w in fp8], args.replays, device))
    del bf16
    sms, smem = decode_tuning.sm_count(device), decode_tuning.smem_bytes(device)
    if name == "gate_up":
        kernel, copies = "tma_swiglu", {"token": quantize_activation(x, "channel")}
    else:
        kernel = "tma"
        copies = {"token": quantize_activation(x, "channel")}
        if name == "down":
            copies["group128"] = quantize_activation(x, "block", group=128)
    configs = decode_tuning.candidates(args.rows, out, inp, "channel", sms, smem, kernel=kernel)
    if args.tiny:
        configs = [c for c in configs if c.block_n <= 64 and c.block_m <= 16][:2] or configs[:1]
    if args.candidates:
        configs = [configs[i] for i in args.candidates if i < len(configs)]
    promote_default = os.environ.get(tma_decode_kernel.PROMOTE_ENV)
    for scales, copy in copies.items():
        xc = x.clone()
        setattr(xc, QUANTIZED_COPY, (copy[0].to(E4M3), copy[1]))
        exact = _exact(name, copy[0].to(E4M3), copy[1], fp8[0])
        for cfg, promote in ((c, p) for c in configs for p in args.promote):
            os.environ[tma_decode_kernel.PROMOTE_ENV] = str(promote)
            if kernel == "tma_swiglu":
                inter = out // 2
                h = torch.empty(args.rows, inter, dtype=dtype, device=device)
                hq = (torch.empty(args.rows, inter, dtype=E4M3, device=device),
                      torch.empty(args.rows, inter // 64, dtype=torch.float32, device=device))
                launches = [lambda w=w, c=cfg: swiglu_gemm_kernel.launch(xc, w, h, c, hq)
                            for w in fp8]
                result = h
            else:
                if scales == "group128" and (cfg.block_k % 128 or
                                             tma_decode_kernel.strip_of_parts(cfg)):
                    continue
                y = torch.empty(args.rows, out, dtype=dtype, device=device)
                launches = [lambda w=w, c=cfg: tma_decode_kernel.launch(xc, w, y, c)
                            for w in fp8]
                result = y
            try:
                launches[0]()
                errors = _errors(result, exact)
                us = _timed(launches, args.replays, device)
            except Exception as e:  # (a config that does not build here: out of shared memory)
                print(json.dumps({"linear": name, "tiles": cfg.as_dict(),
                                  "error": f"{type(e).__name__}: {str(e)[:200]}"}), flush=True)
                continue
            emit(kernel, us, scales=scales, tiles=cfg.as_dict(), promote=promote, **errors)
    if promote_default is None:
        os.environ.pop(tma_decode_kernel.PROMOTE_ENV, None)
    else:
        os.environ[tma_decode_kernel.PROMOTE_ENV] = promote_default
    return rows


def main(argv=None) -> int:
    ap = probe_parser(__doc__)
    ap.add_argument("--linears", nargs="+", default=list(LINEARS), choices=list(LINEARS))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--promote", type=int, nargs="+", default=[128],
                    help="PARALLEL_MODELS_FP8_PROMOTE values to time each config with")
    ap.add_argument("--candidates", type=int, nargs="+", default=None,
                    help="indices into decode_tuning.candidates (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.layers, args.replays, args.rows = 2, 1, min(args.rows, 16)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    shapes = TINY if args.tiny else LINEARS
    results = []
    for name in args.linears:
        results += probe(name, *shapes[name], args, device)
    save(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
