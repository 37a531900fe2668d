"""FP8 decode GEMM sweep: bf16 ``F.linear`` vs our two FP8 decode kernels (W8A16 weight-only and
W8A8 with the activations quantized in the kernel; every candidate tile config and the one
``decode_tuning`` picks) vs ``torch._scaled_mm`` row-wise, per linear shape.

    python bench/fp8_gemm_sweep.py [--shapes 8b 0.89b] [--rows 1 16 64 128 256]
                                   [--scales block channel] [--kernels dynamic weight_only]
                                   [--reps 30] [--out sweep.json]
    python bench/fp8_gemm_sweep.py --tiny     # CPU smoke (Triton's interpreter), seconds
    python bench/fp8_gemm_sweep.py --compile-only 90 [--shapes 8b --rows 64]  # no GPU

Shapes: the decoder linears (N x K) of bench/common.py's Llama shapes at TP 1: qkv, o, gate_up,
down (8B: 6144x4096, 4096x4096, 28672x4096, 4096x14336). Weights random (normal 0.02, bf16), FP8
copies quantized as the rollout does (``--scales``: 128 x 128 blocks with the rollout linears'
scale layout, or per output channel). Per (linear, rows, scales) one JSON line: the median of
``--reps`` runs (CUDA events, the L2 cache flushed before each run: a decode step reads its
weights from HBM) of

- ``bf16``: ``F.linear`` on the bf16 weight;
- ``scaled_mm_rowwise``: ``torch._scaled_mm`` on the channel-scaled FP8 weight with activations
  quantized per row beforehand (the GEMM alone; rows padded to 16), or the error it raised;
- on the gate_up linear, with ``tma``, on CUDA: ``tma_swiglu``, the gate_up GEMM with SwiGLU
  in one kernel (``inference/fp8/swiglu_gemm_kernel.py``: each candidate, the chosen one)
  against ``gemm_then_swiglu_us`` (the TMA GEMM's chosen config, then the SwiGLU producer);
- per decode kernel (``--kernels``; ``weight_only``: ``inference/fp8/weight_only_kernel.py``,
  ``dynamic``: ``inference/fp8/dynamic_act_kernel.py``), a dict under the kernel's name:
  ``configs``, the kernel with each of its ``decode_tuning.candidates``; ``config``, the one
  ``decode_tuning.choose`` settles on in this process (what the rollout engine would run), with
  its time from this sweep (``us``, ``gbps``), ``over_bf16``, and ``max_rel_err`` against the
  kernel's emulation (``gemm.weight_only_matmul``: ``x @ dequantize(W)^T``; ``gemm.
  dynamic_matmul``: ``x`` quantized per token and 128-wide group first; fp32);

times as microseconds and GB/s (the weight's bytes, its scales, the activations read and the
output written, over the time). Then one ``best`` line per (shape, linear, row bucket, scales,
kernel): the fastest candidate config (``decode_tuning.DecodeConfig`` fields), and per (shape,
rows, scales) a ``layer`` line: the four linears' times summed (one decoder layer's GEMMs), bf16,
each kernel's chosen config and ``_scaled_mm`` row-wise (where it ran for all four), and each
over bf16. ``--compile-only SM``: no timing, no GPU: each distinct candidate kernel of each
``--kernels`` compiled for that architecture, with its MMA, shared memory (``fits``: within the
architecture's per-block limit), registers and spills (a kernel edit checked where no GPU is at
hand). ``--tiny``: one 256 x 256 linear, rows 1 and 16, two configs per kernel (the default and a
K split), block scales (and channel ones for the channel-only TMA kernel), one run each on the
CPU (wall time, interpreter: correctness, not speed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if __name__ == "__main__" and "--tiny" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
# each kernel is timed alone: no programmatic dependent launch (inference/fp8/dependent_launch)
os.environ.setdefault("PARALLEL_MODELS_FP8_PDL", "0")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import LLAMA3_8B, LLAMA_089B  # noqa: E402

SHAPES = {"8b": LLAMA3_8B, "0.89b": LLAMA_089B}
TINY_LINEARS = {"tiny": {"proj": (256, 256)}}
KERNELS = ("dynamic", "w8a8", "weight_only", "tma")
# kernel -> (module of inference/fp8, its launch there, the --tiny run's K-split config); its
# emulation: gemm.decode_emulation
KERNEL_PARTS = {"weight_only": ("weight_only_kernel", "launch", (32, 16, 64, 2)),
                "dynamic": ("dynamic_act_kernel", "launch", (32, 16, 128, 2)),
                "w8a8": ("dynamic_act_kernel", "launch_prequantized", (32, 16, 128, 2)),
                "tma": ("tma_decode_kernel", "launch", (32, 16, 128, 2))}
CHANNEL_ONLY = ("tma",)  # kernels that take channel-scaled weights only
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # per block, opt-in


def linears(spec: dict) -> dict:
    """name -> (out, in) of a Llama shape's decoder linears at TP 1."""
    hidden, heads, kv = spec["hidden"], spec["heads"], spec["kv_heads"]
    head_dim = hidden // heads
    return {"qkv": ((heads + 2 * kv) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * spec["intermediate"], hidden), "down": (hidden, spec["intermediate"])}


def _timer(dev, reps: int, flush):
    from parallel_models.inference.fp8.decode_tuning import time_ms

    if dev.type == "cuda":
        return lambda fn: 1e3 * time_ms(fn, warmup=3, reps=reps, flush=flush)

    def wall_us(fn):
        fn()  # (compiles / warms the interpreter)
        t = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t)
    return wall_us


def _weights(out: int, inp: int, dev, granularity: str, gen):
    from parallel_models.inference.fp8.gemm import block_scale_storage
    from parallel_models.inference.fp8.quantize import QuantizedWeight, quantize_weight

    w = (torch.randn(out, inp, device=dev, generator=gen) * 0.02).bfloat16()
    q = quantize_weight(w, granularity)
    if granularity == "block":  # the rollout linears' scale layout (rows padded to 4)
        storage = block_scale_storage(out, inp, dev)
        storage.copy_(q.scale)
        q = QuantizedWeight(q.data, storage, granularity)
    return w, q


def _scaled_mm_rowwise(x, qc):
    from parallel_models.inference.fp8.quantize import quantize_activation

    rows = x.shape[0]
    padded = torch.nn.functional.pad(x, (0, 0, 0, -rows % 16))
    xq, xs = quantize_activation(padded, "channel")
    scale_a, scale_b = xs[:, None].contiguous(), qc.scale[None, :].contiguous()
    return lambda: torch._scaled_mm(xq, qc.data.t(), scale_a=scale_a, scale_b=scale_b,
                                    out_dtype=torch.bfloat16)


def kernel_case(args, kernel, x, q, bf16_us, timer, gbps) -> dict:
    """One decode kernel on one product: every candidate config timed, the chosen one, its error
    against the kernel's emulation."""
    import importlib

    from parallel_models.inference.fp8 import decode_gemm_shared, decode_tuning, gemm

    module, launch_name, split_cfg = KERNEL_PARTS[kernel]
    launch = getattr(importlib.import_module(f"parallel_models.inference.fp8.{module}"),
                     launch_name)
    rows, inp = x.shape
    out = q.shape[0]
    dev = x.device
    y = torch.empty(rows, out, dtype=x.dtype, device=dev)
    quant_us = None
    if kernel == "tma":  # the GEMM alone: its e4m3 input left on x, as a fused producer leaves it
        from parallel_models.inference.fp8 import tma_decode_kernel
        from parallel_models.inference.fp8.quantize import QUANTIZED_COPY

        x = x.detach().clone()
        quant_us = timer(lambda: tma_decode_kernel.quantize_tokens(x))
        setattr(x, QUANTIZED_COPY, tma_decode_kernel.quantize_tokens(x))
    fp8_bytes = q.data.numel() + 4 * q.scale.numel()
    configs = decode_tuning.candidates(rows, out, inp, q.granularity, decode_tuning.sm_count(dev),
                                       decode_tuning.smem_bytes(dev), kernel=kernel)
    if args.tiny:  # the default + a K split
        configs = [decode_tuning.default_config(rows, out, inp, q.granularity, kernel=kernel),
                   decode_tuning.DecodeConfig(*split_cfg, num_warps=4, num_stages=2)]
    res = {"configs": []} if quant_us is None else {"configs": [], "quantize_us": quant_us}
    for cfg in configs:
        try:
            us = timer(lambda: launch(x, q, y, cfg))
        except Exception as exc:  # noqa: BLE001 - a config that does not build here
            res["configs"].append({**cfg.as_dict(), "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        res["configs"].append({**cfg.as_dict(), "us": us, "gbps": gbps(us, fp8_bytes)})
    chosen = decode_tuning.choose(rows, out, inp, q.granularity, dev,
                                  lambda cfg: launch(x, q, y, cfg), kernel=kernel)
    decode_gemm_shared.release_unused_workspaces()  # (split-K buffers of the configs not chosen)
    timed = [c for c in res["configs"]
             if "us" in c and all(c[f] == v for f, v in chosen.as_dict().items())]
    res["config"] = chosen.as_dict()
    res["us"] = timed[0]["us"] if timed else timer(lambda: launch(x, q, y, chosen))
    res["gbps"] = gbps(res["us"], fp8_bytes)
    res["over_bf16"] = res["us"] / bf16_us
    want = gemm.decode_emulation(kernel)(x, q).float()
    got = launch(x, q, y, chosen).float()
    res["max_rel_err"] = float(((got - want).abs() / (want.abs() + 1.0)).max())
    return res


def run_case(args, shape, name, out, inp, rows, granularity, dev, timer, cache) -> dict:
    gen = torch.Generator(device=dev).manual_seed(out * 7 + inp)
    if (name, out, inp, granularity) not in cache:
        cache.clear()  # one shape's weights at a time
        cache[(name, out, inp, granularity)] = _weights(out, inp, dev, granularity, gen)
    w, q = cache[(name, out, inp, granularity)]
    act = torch.bfloat16 if dev.type == "cuda" else torch.float32  # (interpreter: fp32 dots)
    x = torch.randn(rows, inp, device=dev, generator=gen).to(act)
    act_bytes = 2 * (rows * inp + rows * out)

    def gbps(us, weight_bytes):
        return (weight_bytes + act_bytes) / (us * 1e3)

    row = {"shape": shape, "linear": name, "n": out, "k": inp, "rows": rows,
           "scales": granularity, "device": torch.cuda.get_device_name(dev)
           if dev.type == "cuda" else "cpu (interpreter)"}
    row["bf16_us"] = timer(lambda: torch.nn.functional.linear(x.to(w.dtype), w))
    row["bf16_gbps"] = gbps(row["bf16_us"], 2 * w.numel())
    if dev.type == "cuda":
        try:
            from parallel_models.inference.fp8.quantize import quantize_weight

            fn = _scaled_mm_rowwise(x, quantize_weight(w, "channel"))
            row["scaled_mm_rowwise_us"] = timer(fn)
            row["scaled_mm_rowwise_gbps"] = gbps(row["scaled_mm_rowwise_us"], w.numel() + 4 * out)
        except RuntimeError as exc:
            row["scaled_mm_rowwise_error"] = f"{type(exc).__name__}: {exc}"[:200]
    for kernel in args.kernels:
        if kernel in CHANNEL_ONLY and granularity != "channel":
            continue
        row[kernel] = kernel_case(args, kernel, x, q, row["bf16_us"], timer, gbps)
    if name == "gate_up" and "tma" in row and dev.type == "cuda":
        row["tma_swiglu"] = swiglu_case(x, q, row["tma"], timer, gbps)
    return row


def swiglu_case(x, q, tma: dict, timer, gbps) -> dict:
    """The gate_up GEMM with SwiGLU and its output's e4m3 copy in one kernel
    (``swiglu_gemm_kernel``): every candidate timed, the chosen one, against the TMA GEMM's
    chosen config followed by the SwiGLU producer kernel (``producer_kernels``: what the
    decode step ran before)."""
    from parallel_models.inference.fp8 import decode_tuning, swiglu_gemm_kernel
    from parallel_models.inference.fp8.producer_kernels import swiglu_quantized
    from parallel_models.inference.fp8.quantize import QUANTIZED_COPY
    from parallel_models.inference.fp8.tma_decode_kernel import quantize_tokens, tma_mm

    x = x.detach().clone()  # (its e4m3 input left on it, as the norm leaves it: the GEMM alone)
    setattr(x, QUANTIZED_COPY, quantize_tokens(x))
    rows, inp = x.shape
    kernel = swiglu_gemm_kernel.KERNEL
    gate_up = tma_mm(x, q)
    res = {"swiglu_kernel_us": timer(lambda: swiglu_quantized(gate_up))}
    res["gemm_then_swiglu_us"] = tma["us"] + res["swiglu_kernel_us"]
    fp8_bytes = q.data.numel() + 4 * q.scale.numel()
    res["configs"] = []
    for cfg in decode_tuning.candidates(rows, q.shape[0], inp, "channel", kernel=kernel):
        us = timer(lambda: swiglu_gemm_kernel.gate_up_swiglu(x, q, cfg))
        res["configs"].append({**cfg.as_dict(), "us": us, "gbps": gbps(us, fp8_bytes)})
    chosen = swiglu_gemm_kernel.gate_up_swiglu(x, q)  # (tunes the key)
    res["config"] = decode_tuning.chosen_configs()[decode_tuning.key_of(
        rows, q.shape[0], inp, "channel", x.device, kernel)].as_dict()
    res["us"] = min(c["us"] for c in res["configs"] if all(
        c[f] == v for f, v in res["config"].items()))
    res["over_gemm_then_swiglu"] = res["us"] / res["gemm_then_swiglu_us"]
    res["scale_groups"] = getattr(chosen, QUANTIZED_COPY)[1].shape[1]
    return res


def best_lines(rows: list[dict], kernels) -> list[dict]:
    """The fastest candidate per (shape, linear, row bucket, scales, kernel)."""
    from parallel_models.inference.fp8.decode_tuning import row_bucket

    best = {}
    for r in rows:
        for kernel in kernels:
            key = (r["shape"], r["linear"], r["n"], r["k"], row_bucket(r["rows"]), r["scales"],
                   kernel)
            for c in r.get(kernel, {}).get("configs", ()):
                if "us" in c and (key not in best or c["us"] < best[key]["us"]):
                    best[key] = c
    return [{"best": dict(zip(("shape", "linear", "n", "k", "row_bucket", "scales", "kernel"),
                              key)),
             "config": {f: v for f, v in c.items() if f not in ("us", "gbps")}, "us": c["us"],
             "gbps": c["gbps"]} for key, c in best.items()]


def layer_lines(rows: list[dict], kernels) -> list[dict]:
    """Per (shape, rows, scales): one decoder layer's four GEMMs, bf16 vs each kernel's chosen
    config vs ``_scaled_mm`` row-wise (the GEMM alone, where it ran for every linear)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["shape"], r["rows"], r["scales"]), []).append(r)
    out = []
    for (shape, n_rows, scales), rs in groups.items():
        line = {"layer": {"shape": shape, "rows": n_rows, "scales": scales}, "linears": len(rs),
                "bf16_us": sum(r["bf16_us"] for r in rs)}
        timed = {kernel: sum(r[kernel]["us"] for r in rs) for kernel in kernels
                 if all(kernel in r for r in rs)}
        if all("scaled_mm_rowwise_us" in r for r in rs):
            timed["scaled_mm_rowwise"] = sum(r["scaled_mm_rowwise_us"] for r in rs)
        for name, us in timed.items():
            line[f"{name}_us"] = us
            line[f"{name}_over_bf16"] = us / line["bf16_us"]
        out.append(line)
    return out


def register_usage(compiled) -> dict:
    """``registers`` and ``spill_bytes`` (stack) of a Triton kernel compiled for a CUDA target,
    from ``cuobjdump --dump-resource-usage`` of its cubin (Triton's bundled binary)."""
    import re
    import subprocess
    import tempfile

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name],
                               capture_output=True, text=True).stdout
    found = {m: int(v) for m, v in re.findall(r"(REG|STACK):(\d+)", usage)}
    return {"registers": found.get("REG"), "spill_bytes": found.get("STACK")}


def _compile(kernel_fn, consts: dict, cfg, arch: int) -> dict:
    """One kernel variant compiled for ``sm_<arch>``: its MMA, shared memory, registers and
    spill bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ints = ("M", "N", "K", "stride_xm", "stride_wn", "stride_ym", "stride_sn", "ws_rows",
            "SPLIT_K", "stride_xsm", "stride_xsg", "stride_xs", "stride_w")
    x_type = "*fp8e4nv" if consts.get("PREQUANT") else "*bf16"
    sig = {"X": x_type, "W": "*fp8e4nv", "S": "*fp32", "Y": "*bf16", "P": "*fp32", "C": "*i32",
           "XS": "*fp32", **{n: "i32" for n in ints},
           "x_desc": f"tensordesc<fp8e4nv[{cfg.block_m}, {cfg.block_k}]>"}  # (the TMA kernel)
    if "w_desc" in kernel_fn.arg_names:  # (one weight descriptor per strip part)
        from parallel_models.inference.fp8.tma_decode_kernel import descriptor_blocks

        for name, (rows, cols) in zip(("w_desc", "w_desc2", "w_desc3", "w_desc4"),
                                      descriptor_blocks(cfg)):
            sig[name] = f"tensordesc<fp8e4nv[{rows}, {cols}]>"
    sig = {n: sig[n] for n in kernel_fn.arg_names if n in sig}  # (this kernel's arguments)
    aligned = ("X", "W", "S", "Y", "P", "C", "N", "K", "stride_xm", "stride_wn", "stride_ym",
               "stride_w")
    attrs = {(kernel_fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned
             if n in kernel_fn.arg_names}
    consts = {c: v for c, v in consts.items() if c in kernel_fn.arg_names}
    src = ASTSource(fn=kernel_fn, signature={**sig, **{c: "constexpr" for c in consts}},
                    constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={
        "num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    shared = k.metadata.shared
    return {"wgmma": "warp_group_dot" in k.asm["ttgir"], "shared": shared,
            "fits": shared <= SMEM_LIMIT.get(arch, SMEM_LIMIT[90]), **register_usage(k)}


def compile_only(plan: dict, rows_list, scales, arch: int, kernels=KERNELS) -> list[dict]:
    """Every distinct candidate kernel of the plan compiled for ``sm_<arch>`` without a GPU
    (Triton's ``compile`` with a target, the ptxas it ships): its MMA (``wgmma`` or ``mma``),
    shared memory (and whether it fits the architecture's per-block limit), registers and
    spill bytes (``cuobjdump --dump-resource-usage``)."""
    from parallel_models.inference.fp8.decode_tuning import candidates
    from parallel_models.inference.fp8.dependent_launch import PREFETCH_KB, lines_for
    from parallel_models.inference.fp8.dynamic_act_kernel import _w8a8_dynamic_kernel
    from parallel_models.inference.fp8.quantize import E4M3_MAX
    from parallel_models.inference.fp8.tma_decode_kernel import (
        PROMOTE_EVERY, _w8a8_tma_kernel, _w8a8_tma_strip_kernel, part_constexprs, strip_of_parts)
    from parallel_models.inference.fp8.weight_only_kernel import _w8a16_kernel

    fns = {"weight_only": (_w8a16_kernel, {"BIT_CONVERT": True}),
           "dynamic": (_w8a8_dynamic_kernel, {"FP8_MAX": E4M3_MAX, "EMULATE": False,
                                              "PREQUANT": False}),
           "w8a8": (_w8a8_dynamic_kernel, {"FP8_MAX": E4M3_MAX, "EMULATE": False,
                                           "PREQUANT": True}),
           "tma": (_w8a8_tma_kernel, {"PROMOTE": PROMOTE_EVERY, "EMULATE": False,
                                      "PDL": True})}  # (as on Hopper: dependent_launch)
    lines, seen = [], set()
    for kernel in kernels:
        kernel_fn, own = fns[kernel]
        for lins in plan.values():
            for out, inp in lins.values():
                for rows in rows_list:
                    for gran in scales:
                        if kernel in CHANNEL_ONLY and gran != "channel":
                            continue
                        for cfg in candidates(rows, out, inp, gran, kernel=kernel):
                            key = (kernel, gran, cfg.block_n, cfg.block_m, cfg.block_k,
                                   cfg.num_warps, cfg.num_stages, cfg.tokens_first,
                                   inp % cfg.block_k == 0)
                            if key in seen:
                                continue
                            seen.add(key)
                            consts = {"BLOCK_SCALES": gran == "block", "EVEN_K": key[-1],
                                      "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                                      "BLOCK_K": cfg.block_k, "GROUP": 128,
                                      "TOKENS_FIRST": cfg.tokens_first, **own}
                            fn = kernel_fn
                            if kernel == "tma" and strip_of_parts(cfg):  # (BLOCK_N: part 1)
                                fn = _w8a8_tma_strip_kernel
                                consts.update(part_constexprs(cfg))
                            elif kernel == "tma":  # (the default prefetch before the wait)
                                consts["LINES"] = lines_for(PREFETCH_KB * 1024, cfg.block_n,
                                                            inp // max(1, cfg.split_k or 1))
                            tiles = {f: v for f, v in cfg.as_dict().items() if f != "split_k"}
                            lines.append({"compiled": {"kernel": kernel, "scales": gran,
                                                       **tiles},  # (split: run time)
                                          "sm": arch, **_compile(fn, consts, cfg, arch)})
                            print(json.dumps(lines[-1]), flush=True)
    return lines


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["8b", "0.89b"], choices=list(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    ap.add_argument("--scales", nargs="+", default=["block", "channel"],
                    choices=("block", "channel"))
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS,
                    help="the FP8 decode kernels to time (or compile)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run (Triton's interpreter)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile-only", type=int, metavar="SM", default=None,
                    help="no GPU needed: compile every candidate for sm_SM (e.g. 90) and print "
                         "its shared memory, registers and spills")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if args.tiny:
        plan = {"tiny": TINY_LINEARS["tiny"]}
        args.rows = [1, 16]
        args.scales = ["block"] + (["channel"] if set(args.kernels) & set(CHANNEL_ONLY) else [])
    else:
        plan = {shape: linears(SHAPES[shape]) for shape in args.shapes}
    if args.compile_only:
        return compile_only(plan, args.rows, args.scales, args.compile_only, args.kernels)
    from parallel_models.inference.fp8.decode_tuning import l2_flush_buffer

    timer = _timer(dev, args.reps, l2_flush_buffer(dev) if dev.type == "cuda" else None)
    started, rows, cache = time.perf_counter(), [], {}
    with torch.no_grad():
        for shape, lins in plan.items():
            for granularity in args.scales:
                for name, (out, inp) in lins.items():
                    for r in args.rows:
                        row = run_case(args, shape, name, out, inp, r, granularity, dev, timer,
                                       cache)
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    summary = best_lines(rows, args.kernels) + layer_lines(rows, args.kernels)
    for line in summary:
        print(json.dumps(line), flush=True)
    print(json.dumps({"sweep_s": time.perf_counter() - started}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "cases": rows,
                       "summary": summary}, f, indent=1)
    return rows + summary


if __name__ == "__main__":
    main()
