"""FP8 rollout vs bf16: the continuous engine's decode step, alternated in one process.

    python bench/fp8_decode.py [--shapes 0.89b 8b] [--batches 64 256] [--scales block]
                               [--decode-kernels dynamic weight_only]
                               [--rounds 3] [--iters 5] [--out fp8.json] [--kv-fp8]
    python bench/fp8_decode.py --grpo [--grpo-prompts 64 --grpo-n 8 --grpo-cap 2048]
    python bench/fp8_decode.py --tiny --device cpu       # smoke run (a few seconds on the CPU)

Per shape (``0.89b``, ``8b``: bench/common.py's Llama shapes, random weights drawn on the device
as ``common.build_random_llama`` does, bf16; ``--tiny``: a 2-layer 64-wide model) and batch size
B: one model, ``ContinuousEngine`` s on it, B rows each (prompt ``--prompt`` tokens, greedy, EOS
ignored): one whose decode runs the bf16 linears (``bf16``) and, per ``--decode-kernels`` entry,
one whose linears run on FP8 copies (``inference/fp8``: ``Fp8Linears``, ``--scales`` block |
channel) with ``gemm.DECODE_KERNEL`` set to that kernel (``fp8_dynamic``: W8A8, the activations
quantized inside the decode GEMM; ``fp8_weight_only``: W8A16) for the products of at most
``gemm.DECODE_ROWS`` rows (larger ones run ``_scaled_mm`` either way; ``fp8_scaled_mm``: no decode
kernel, ``_scaled_mm`` at every size). Each engine's first step
prefills and captures its bucket's CUDA graph (the FP8 ones with the FP8 linears on and their
kernel selected, so replaying it runs those GEMMs whatever the switches say after). Then
``engine.step()`` of the engines is timed side by side (``common.alternate``: ``--rounds``
rounds in rotated order, the median of ``--iters`` timed calls after ``--warmup``, CUDA events;
each call runs ``--chain`` consecutive steps, as ``generate`` does: the continuous engine's
pipelined decode queues a step before reading the previous one's tokens, so the host's part of
a step runs while the GPU works on the one before and a step costs its GPU time; ``--chain 1``
times every step alone, the synchronization after it exposing the host's part, as the figures
of sessions <= 18 did), and one JSON line per (shape, batch) is printed: per engine its median
per step (``<name>_step_ms``), its
spread ((max - min) / median over rounds) and, for the FP8 ones, ``<name>_over_bf16``; the FP8
GEMM backend of the larger products (``scaled_mm``, or ``emulated`` where the GPU / torch
cannot), ``decode_kernel_checks`` (per kernel, whether it passed ``gemm``'s device check: one
that failed is replaced by the other) and ``decode_tiles``: per kernel, the tiles
``inference/fp8/decode_tuning`` chose per linear shape (timed during the FP8 engine's first,
eager decode step); ``graph_tuning``: the comparisons ``inference/fp8/graph_tuning``'s pass made
in the captured step (a capture with the pass on, the default) and ``graph_tuning_s`` its time.
Contender flags (``+...`` after a kernel): :func:`_flag_env`. ``--kv-fp8``: two engines more
with the KV pool in e4m3 (``rollout.kv_cache_dtype=fp8``, ``pool_cache``): ``bf16_kvfp8`` (bf16
linears) and ``fp8_<first decode kernel>_kvfp8`` (FP8 linears too). ``--out`` also writes every
line and the run's settings as one JSON file.
The 8B shape needs about 40 GiB at B = 256 with both kernels (weights, their FP8 copy, three KV
pools of B x (prompt + 25) positions).

``--grpo`` (first shape only): bench/rollout_bench.py's GRPO-shaped workload (``grpo_case``:
prompts x n samples, lognormal response lengths, static and continuous batching) once with the
bf16 linears and once per decode kernel with the FP8 ones; one JSON line each (useful tokens/s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import LLAMA3_8B, LLAMA_089B, alternate, build_random_llama  # noqa: E402

SHAPES = {"0.89b": LLAMA_089B, "8b": LLAMA3_8B,
          "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512)}


def _cpu_alternate(contenders: dict, rounds: int, warmup: int, iters: int) -> dict:
    """``common.alternate`` on the CPU (wall time, no clock log)."""
    times = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = contenders[name]
            for _ in range(warmup):
                fn()
            calls = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                calls.append(time.perf_counter() - t)
            times[name].append(sorted(calls)[len(calls) // 2])
    out = {}
    for name, ts in times.items():
        med = sorted(ts)[len(ts) // 2]
        out[name] = {"median_s": med, "spread": (max(ts) - min(ts)) / med, "rounds_s": ts}
    return out


def _engine(model, batch: int, prompt: int, new: int, vocab: int, seed: int,
            kv_cache_dtype: str = "bf16"):
    from parallel_models.inference.continuous import ContinuousEngine
    from parallel_models.inference.sampling import SamplingParams

    row_tokens = prompt + new
    eng = ContinuousEngine(model, batch * row_tokens, max_rows=batch, max_row_tokens=row_tokens,
                           kv_cache_dtype=kv_cache_dtype)
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=new)
    for p in torch.randint(0, vocab, (batch, prompt), generator=g).tolist():
        eng.submit(p, params)
    eng.step()  # prefill + first decode step (captures the bucket's graph on CUDA)
    return eng


def _flag_env(flag: str):
    """(variable, value) a contender flag sets at graph capture, None for ``unfused`` (a
    module switch): ``nopdl`` (the FP8 kernels' dependent launch off), ``noattnpdl`` (the
    attention's), ``pf<KiB>`` (each FP8 decode GEMM program's L2 prefetch before its wait, KiB;
    ``pf0``: none), ``tiles=<pins>`` (decode GEMM tiles instead of the tuner's:
    ``decode_tuning.pinned_configs``, e.g. ``tiles=64:4096x4096=32,64,256,1,4,4,tf``),
    ``nographtuning`` (``graph_tuning``'s pass off at its capture: list it before the contenders
    with the pass, which is on by default and whose verdicts then stay for the process),
    ``graphtuned`` (the pass asked for explicitly) and ``promote<N>`` (the TMA kernels' FP8 MMA
    promoted to fp32 every N inputs: ``promote128``; ``promote0``, the default, never:
    ``tma_decode_kernel.PROMOTE_ENV``; the tuner's choices are the process's, made under the
    first contender's setting).
    The names come from ``dependent_launch`` and ``tma_decode_kernel``, which import triton:
    only here."""
    if flag == "unfused":
        return None
    if flag.startswith("promote"):
        try:
            from parallel_models.inference.fp8.tma_decode_kernel import PROMOTE_ENV
        except ImportError:  # (no triton: no kernel this variable switches)
            return None
        return PROMOTE_ENV, flag[len("promote"):]
    if flag in ("graphtuned", "nographtuning"):
        from parallel_models.inference.fp8.graph_tuning import ENV

        return ENV, "1" if flag == "graphtuned" else "0"
    if flag.startswith("tiles="):
        from parallel_models.inference.fp8.decode_tuning import PIN_ENV

        return PIN_ENV, flag[len("tiles="):]
    try:
        from parallel_models.inference.fp8 import dependent_launch as dl
    except ImportError:  # (no triton: no kernel these variables switch)
        return None

    if flag == "nopdl":
        return dl.ENV, "0"
    if flag == "noattnpdl":
        return dl.ATTENTION_ENV, "0"
    return dl.PREFETCH_ENV, flag[2:]


def _selector():
    """``select(kernel)``: ``gemm``'s decode switches for one engine (``kernel``: a decode
    kernel, ``"<kernel>@<rows>"`` with ``DECODE_ROWS`` set to rows; ``"scaled_mm"``: no decode
    kernel, ``DECODE_ROWS`` 0, ``_scaled_mm`` at every size; ``"bf16"``: the bf16 linears;
    flags: ``+unfused``, the gate_up GEMM and SwiGLU as two kernels
    (``fused_producers.FUSE_GATE_UP`` off), and the variables of :func:`_flag_env`; None: the
    defaults, which ``select`` restores), the defaults read now. The switches hold at the
    engine's graph capture, so engines that differ in them are timed side by side."""
    from parallel_models.inference.fp8 import fused_producers, gemm

    default_kernel, default_rows = gemm.DECODE_KERNEL, gemm.DECODE_ROWS
    default_fuse, env_defaults = fused_producers.FUSE_GATE_UP, {}

    def select(kernel):
        base, *flags = (kernel or "").split("+")
        name, _, rows = base.partition("@")
        gemm.DECODE_KERNEL = default_kernel if name in ("", "scaled_mm", "bf16") else name
        gemm.DECODE_ROWS = 0 if name == "scaled_mm" else int(rows or default_rows)
        fused_producers.FUSE_GATE_UP = default_fuse and "unfused" not in flags
        wanted = dict(filter(None, map(_flag_env, flags)))
        for var in wanted:
            env_defaults.setdefault(var, os.environ.get(var))
        for var, default in env_defaults.items():
            value = wanted.get(var, default)
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value

    return select


DECODE_CONTENDERS = ("dynamic", "w8a8", "weight_only", "tma", "scaled_mm", "bf16")
CONTENDER_FLAGS = ("unfused", "nopdl", "noattnpdl", "graphtuned", "nographtuning", "pf<KiB>",
                   "promote<N>", "tiles=<pins>")


def _contender(text: str) -> str:
    """``--decode-kernels`` entry: a decode kernel, ``scaled_mm`` or ``bf16`` (another bf16
    engine: with flags), optionally ``@rows``, then any of :data:`CONTENDER_FLAGS`."""
    base, *flags = text.split("+")
    name, _, rows = base.partition("@")
    if name not in DECODE_CONTENDERS or (rows and not rows.isdigit()) or \
            any(flag not in CONTENDER_FLAGS[:-3] and not flag.startswith("tiles=") and not
                any(flag.startswith(p) and flag[len(p):].isdigit() for p in ("pf", "promote"))
                for flag in flags):
        raise argparse.ArgumentTypeError(f"{text!r}: one of {DECODE_CONTENDERS}, optionally "
                                         "@<rows> (gemm.DECODE_ROWS), then any of "
                                         f"{['+' + f for f in CONTENDER_FLAGS]}")
    for flag in flags:
        if flag.startswith("tiles="):
            try:
                _pins(flag)
            except ValueError as err:
                raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None
    return text


def _pins(flag: str) -> dict:
    """The decode tiles a ``tiles=`` flag pins (``decode_tuning.pinned_configs``)."""
    from parallel_models.inference.fp8.decode_tuning import pinned_configs

    return pinned_configs(flag[len("tiles="):])


def _kernel_of(contender: str) -> str:
    """The decode kernel of a ``--decode-kernels`` entry (``"tma@64+nopdl"`` -> ``"tma"``)."""
    return contender.split("+")[0].partition("@")[0]


def _is_fp8(kernel) -> bool:
    """Whether a contender (None: the bf16 engine) runs the FP8 linears."""
    return kernel is not None and _kernel_of(kernel) != "bf16"


def _fp8_on(fp8, kernel):
    """An FP8 contender runs inside ``fp8.enabled()``, as the engine's generate does (the FP8
    forward on, the norms and SwiGLU writing e4m3 copies for the TMA kernel: ``fused_producers``);
    the bf16 contender (``kernel`` None) outside it (``fp8`` is built inactive)."""
    return fp8.enabled() if _is_fp8(kernel) else contextlib.nullcontext()


def run_case(args, shape: str, model, fp8, dev, batch: int) -> dict:
    from parallel_models.inference.fp8 import gemm

    spec = SHAPES[shape]
    new = 4 + args.rounds * (args.warmup + args.iters) * args.chain  # rows never finish
    select = _selector()
    engines = {"bf16": (_engine(model, batch, args.prompt, new, spec["vocab"], batch), None)}
    for kernel in args.decode_kernels:
        select(kernel)
        with _fp8_on(fp8, kernel):
            name = f"fp8_{kernel}" if _is_fp8(kernel) else kernel
            engines[name] = (_engine(model, batch, args.prompt, new, spec["vocab"], batch),
                             kernel)
    if args.kv_fp8:  # the KV pool in e4m3: with the bf16 linears, and with the first kernel's
        for kernel in [None] + args.decode_kernels[:1]:
            select(kernel)
            with _fp8_on(fp8, kernel):
                engines[f"{'fp8_' + kernel if kernel else 'bf16'}_kvfp8"] = (
                    _engine(model, batch, args.prompt, new, spec["vocab"], batch, "fp8"), kernel)

    def step(engine, kernel):
        # (eager parts of a step; the captured graphs hold their GEMMs)
        select(kernel)
        with _fp8_on(fp8, kernel):
            for _ in range(args.chain):
                engine.step()

    contenders = {name: (lambda e=engine, k=kernel: step(e, k))
                  for name, (engine, kernel) in engines.items()}
    if dev.type == "cuda":
        timing = alternate(contenders, rounds=args.rounds, warmup=args.warmup, iters=args.iters,
                           clock_log_ms=0)
    else:
        timing = _cpu_alternate(contenders, args.rounds, args.warmup, args.iters)
    select(None)
    backends = sorted({m.fp8_backend for _, m in fp8.modules if m.fp8_backend})
    fp8_engines = [engine for engine, kernel in engines.values() if _is_fp8(kernel)]
    row = {"shape": shape, "batch": batch, "prompt": args.prompt, "chain": args.chain,
           "scales": fp8.granularity,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "cuda_graph": all(any(s.graph is not None for s in e._steps.values())
                             for e in fp8_engines),
           "fp8_gemm": backends, "decode_rows": gemm.DECODE_ROWS,
           "decode_kernel_checks": {f"{k[2]}": ok for k, ok in gemm._decode_checked.items()
                                    if k[1] == fp8.granularity}}
    from parallel_models.inference.fp8.decode_tuning import chosen_configs, row_bucket
    from parallel_models.inference.fp8 import graph_tuning
    from parallel_models.inference.fp8.graph_tuning import alone_choices, graph_timings

    def tiles(contender):  # (out x in, then a fused kernel's name) -> the chosen tiles
        kernel = _kernel_of(contender)
        flags, pins = contender.split("+")[1:], {}  # (its +tiles= pins: what its graph runs)
        for flag in flags:
            if flag.startswith("tiles="):
                pins.update(_pins(flag))
        chosen = chosen_configs()
        if "nographtuning" in flags:  # (listed first, it ran the configs timed alone)
            chosen.update(alone_choices)
        chosen = {key: pins.get((key[0], key[1], key[2], key[5]), cfg)
                  for key, cfg in chosen.items()}
        return {f"{key[1]}x{key[2]}" + (f" {key[5]}" if key[5] != kernel else ""): cfg.as_dict()
                for key, cfg in chosen.items()
                if key[0] == row_bucket(batch) and key[3] == fp8.granularity
                and key[5].startswith(kernel)}

    row["decode_tiles"] = {contender: tiles(contender) for contender in args.decode_kernels
                           if _is_fp8(contender)}
    row["graph_tuning"] = [  # the second pass's comparisons (the step's ms both ways)
        {"linear": f"{key[1]}x{key[2]} {key[5]}", "tiles": cfg.as_dict(), "step_ms": new,
         "current_ms": now, "kept": kept}
        for key, cfg, new, now, kept in graph_timings
        if key[0] == row_bucket(batch) and key[3] == fp8.granularity]
    row["graph_tuning_s"] = graph_tuning.seconds  # (the process's so far: every engine's start)
    for name in contenders:
        row[f"{name}_step_ms"] = 1e3 * timing[name]["median_s"] / args.chain
        row[f"{name}_spread"] = timing[name]["spread"]
        if name != "bf16":
            row[f"{name}_over_bf16"] = row[f"{name}_step_ms"] / row["bf16_step_ms"]
    del engines, fp8_engines, contenders
    return row


def grpo_both_ways(args, shape: str, model, fp8) -> list[dict]:
    """rollout_bench's GRPO workload with the bf16 linears, then with the FP8 ones (once per
    decode kernel)."""
    from rollout_bench import grpo_case

    cfg = types.SimpleNamespace(vocab_size=SHAPES[shape]["vocab"])
    out, select = [], _selector()
    for dtype, kernel in [("bf16", None)] + [("fp8" if _is_fp8(k) else "bf16", k)
                                             for k in args.decode_kernels]:
        select(kernel)
        with _fp8_on(fp8, kernel):
            row = {"shape": shape, "case": "grpo", "weights": dtype, "decode_kernel": kernel,
                   **grpo_case(args, cfg, model)}
        print(json.dumps(row), flush=True)
        out.append(row)
    select(None)
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["0.89b", "8b"], choices=list(SHAPES))
    ap.add_argument("--tiny", action="store_true", help="the tiny shape only (smoke run)")
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help="default 64 256 (--tiny: 4)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--scales", choices=("block", "channel"), default="channel")
    ap.add_argument("--decode-kernels", nargs="+", default=["dynamic", "w8a8", "weight_only"],
                    type=_contender,
                    help="one FP8 engine per decode kernel (gemm.DECODE_KERNEL; kernel@rows: "
                         "with gemm.DECODE_ROWS rows), alternated with the bf16 engine")
    ap.add_argument("--kv-fp8", action="store_true",
                    help="also engines with the KV pool in e4m3 (rollout.kv_cache_dtype=fp8)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--chain", type=int, default=4,
                    help="consecutive engine steps per timed call (1: each step alone)")
    ap.add_argument("--grpo", action="store_true", help="also the GRPO-shaped workload")
    ap.add_argument("--grpo-prompts", type=int, default=64)
    ap.add_argument("--grpo-n", type=int, default=8)
    ap.add_argument("--grpo-cap", type=int, default=2048)
    ap.add_argument("--static-batch", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shapes = ["tiny"] if args.tiny else args.shapes
    batches = args.batches or ([4] if args.tiny else [64, 256])
    if args.tiny:
        args.prompt = min(args.prompt, 8)

    import parallel_models as pm
    from parallel_models.inference.fp8 import Fp8Linears

    pm.init_parallel()
    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for shape in shapes:
        shape_args = types.SimpleNamespace(**SHAPES[shape])
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        model = build_random_llama(shape_args, pm.LlamaForCausalLMRmPad, seed=0)
        model.requires_grad_(False)
        fp8 = Fp8Linears(model, args.scales, active=False)
        with torch.no_grad():
            for batch in batches:
                row = run_case(args, shape, model, fp8, dev, batch)
                print(json.dumps(row), flush=True)
                rows.append(row)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            if args.grpo and shape == shapes[0]:
                rows += grpo_both_ways(args, shape, model, fp8)
        del model, fp8
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "cases": rows}, f,
                      indent=1)
    pm.destroy_parallel()
    return rows


if __name__ == "__main__":
    main()
