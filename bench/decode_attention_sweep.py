"""Split-KV decode attention: its launch configs swept at the engine's shapes, timed like the
engine runs it (issue 17 item 4).

    python bench/decode_attention_sweep.py [--batches 64 256] [--contexts 256 2048]
        [--bucket 384] [--budget-s 80] [--full] [--out sweep.json]
    TRITON_INTERPRET=1 python bench/decode_attention_sweep.py --device cpu --batches 2 \\
        --contexts 40 --heads 4 --kv-heads 2 --head-dim 16 --bucket 64 --budget-s 20  # smoke

Shapes: every (batch, context) pair, 16 query / 8 KV heads, head_dim 128, bf16; rows hold
``max(context, bucket)`` positions (the engine's bucket: prompt 128 + new 256 = 384).

Timing (``graph_us``): ``--reps`` calls captured in ONE CUDA graph, replayed between CUDA events,
microseconds per call: what the engine's captured decode step pays (no launch or host cost).
The calls cycle over several copies of the KV pool ("layers", > 256 MB in all) so that, as in
the engine, a call does not find the previous call's KV in L2. ``eager_us`` beside it: the old
micro-bench's figure (one eager call between events: launch and host time included).

Search per shape, within ``--budget-s`` (shared equally by the shapes): from the current config
(``split_kv_config.launch_config``), split sizes, then ``block_n`` (the tile over KV positions),
``num_warps``, ``num_stages``, each axis keeping the best so far; ``--full`` then tries the whole
grid. Each config's output is checked against the default's (bf16: 2e-2 + 2% of the value)
before it is timed; a config that fails (compilation, resources, values) is recorded, skipped.
Reports per shape: the KV-bytes floor at the HBM bandwidth, the default's and the best config's
microseconds and ``x floor``, and the value to apply the best:
``PARALLEL_MODELS_DECODE_KERNEL_CONFIG=block_n,warps,stages,split`` (or ``split_kv_config.TUNED``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import graph_us, timed  # noqa: E402  (bench/common.py: the timing methods)

SPLITS = (32, 64, 128, 256, 512, 1024, 2048)
BLOCK_NS = (16, 32, 64, 128)
WARPS = (2, 4, 8)
STAGES = (1, 2, 3, 4)


def bandwidth(dev: torch.device) -> float:
    if dev.type != "cuda":
        return 50e9  # nominal: the smoke run's floors mean nothing
    name = torch.cuda.get_device_name()
    return 4.8e12 if "H200" in name else 3.35e12 if "H100" in name else 2.0e12


def eager_us(fn, dev, iters: int = 20) -> float:
    """One eager call between CUDA events (launch + host time included), median."""
    if dev.type != "cuda":
        return graph_us([fn], dev, iters)
    return 1e6 * timed(fn, warmup=1, iters=iters)


class Shape:
    """One layer's decode attention inputs at (batch, context), on ``layers`` pool copies."""

    def __init__(self, batch, context, max_row, heads, kv_heads, dim, dev, dtype):
        g = torch.Generator(device=dev).manual_seed(0)
        self.batch, self.context, self.max_row, self.kv_heads = batch, context, max_row, kv_heads
        positions = batch * max_row
        pool_bytes = 2 * positions * kv_heads * dim * torch.tensor([], dtype=dtype).element_size()
        layers = 1 if dev.type != "cuda" else max(1, min(8, math.ceil(256e6 / pool_bytes)))

        def rand(*shape):
            return torch.randn(*shape, device=dev, dtype=dtype, generator=g)

        self.pools = [(rand(positions, kv_heads, dim), rand(positions, kv_heads, dim))
                      for _ in range(layers)]
        self.q, self.k_new, self.v_new = (rand(batch, heads, dim), rand(batch, kv_heads, dim),
                                          rand(batch, kv_heads, dim))
        self.offsets = torch.arange(batch, device=dev) * max_row
        self.used = torch.full((batch,), context, device=dev, dtype=torch.int32)
        self.scale = dim ** -0.5
        self.kv_bytes = 2 * batch * context * kv_heads * dim * self.q.element_size()
        self.floor_us = 1e6 * self.kv_bytes / bandwidth(torch.device(dev))

    def calls(self, config):
        from parallel_models.inference.split_kv_attention import split_kv_decode

        def make(k_pool, v_pool):
            return lambda: split_kv_decode(self.q, self.k_new, self.v_new, k_pool, v_pool,
                                           self.offsets, self.used, self.max_row, self.scale,
                                           config=config)
        return [make(k, v) for k, v in self.pools]


def auto_split(shape: Shape, config, dev) -> int:
    from parallel_models.inference.split_kv_attention import split_size

    return split_size(shape.batch, shape.kv_heads, shape.max_row, dev, config)


def sweep_shape(shape: Shape, dev, budget_s: float, full: bool, reps: int) -> dict:
    """Coordinate search (then the grid with ``full``) within ``budget_s`` seconds."""
    from parallel_models.inference.split_kv_config import LaunchConfig, launch_config

    t0 = time.perf_counter()
    start = launch_config(shape.batch, shape.max_row)
    start = LaunchConfig(start.block_n, start.num_warps, start.num_stages,
                         start.split or auto_split(shape, start, dev))
    want = shape.calls(start)[0]().float()
    tried: dict = {}

    def measure(config) -> float:
        if config in tried:
            return tried[config].get("us", math.inf)
        if time.perf_counter() - t0 > budget_s:
            return math.inf
        try:
            got = shape.calls(config)[0]().float()
            err = ((got - want).abs() - 2e-2 * want.abs()).max().item()
            if not err <= 2e-2:
                raise AssertionError(f"output differs from the default config's by {err}")
            tried[config] = {"us": graph_us(shape.calls(config), dev, reps)}
        except Exception as exc:  # noqa: BLE001 - record it, try the next config
            tried[config] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        return tried[config].get("us", math.inf)

    best = start
    measure(start)
    top = 1 << max(4, (shape.max_row - 1).bit_length())
    axes = (("split", [s for s in SPLITS if s <= top]), ("block_n", BLOCK_NS),
            ("num_warps", WARPS), ("num_stages", STAGES))
    for name, values in axes:
        for value in values:
            fields = {**best.__dict__, name: value}
            if fields["block_n"] > fields["split"]:
                continue
            config = LaunchConfig(**fields)
            if measure(config) < measure(best):
                best = config
    if full:
        for split, block_n, warps, stages in itertools.product(
                [s for s in SPLITS if s <= top], BLOCK_NS, WARPS, STAGES):
            if block_n <= split:
                config = LaunchConfig(block_n, warps, stages, split)
                if measure(config) < measure(best):
                    best = config
    default_us = tried[start].get("us", math.inf)
    best_us = tried[best].get("us", math.inf)
    return {"batch": shape.batch, "context": shape.context, "max_row_tokens": shape.max_row,
            "layers_cycled": len(shape.pools), "kv_bytes": shape.kv_bytes,
            "floor_us": shape.floor_us, "default": start.as_env(), "default_us": default_us,
            "default_eager_us": eager_us(shape.calls(start)[0], dev),
            "best": best.as_env(), "best_us": best_us, "best_over_floor": best_us / shape.floor_us,
            "default_over_floor": default_us / shape.floor_us, "configs_tried": len(tried),
            "seconds": time.perf_counter() - t0,
            "tried": {c.as_env(): r for c, r in tried.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--bucket", type=int, default=384, help="positions per row at least")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=80.0, help="search seconds, all shapes")
    ap.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--full", action="store_true", help="then the whole grid (budget allowing)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = [(b, c) for b in args.batches for c in args.contexts]
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
           "args": vars(args), "shapes": [], "errors": []}
    for batch, context in shapes:
        try:
            shape = Shape(batch, context, max(context, args.bucket), args.heads, args.kv_heads,
                          args.head_dim, dev, dtype)
            res["shapes"].append(sweep_shape(shape, dev, args.budget_s / len(shapes), args.full,
                                             args.reps))
            del shape
        except Exception as exc:  # noqa: BLE001 - record it, run the next shape
            res["errors"].append(f"{batch}x{context}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
    print("| batch | context | KV floor us | default (block_n,warps,stages,split) us | x floor "
          "| eager 1-call us | best config | best us | x floor | configs |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in res["shapes"]:
        print(f"| {s['batch']} | {s['context']} | {s['floor_us']:.1f} | {s['default']}: "
              f"{s['default_us']:.1f} | {s['default_over_floor']:.2f} | "
              f"{s['default_eager_us']:.1f} | {s['best']} | {s['best_us']:.1f} | "
              f"{s['best_over_floor']:.2f} | {s['configs_tried']} |")
    for s in res["shapes"]:
        print(f"apply {s['batch']}x{s['context']}: "
              f"PARALLEL_MODELS_DECODE_KERNEL_CONFIG={s['best']}")
    if res["errors"]:
        print("ERRORS:", *res["errors"], sep="\n  ")


if __name__ == "__main__":
    main()
