"""Skinny decode GEMM vs cuBLAS at the decode linears' shapes, timed like the engine runs them,
and the kernel's launch configs swept (issue 17 item 4).

    python bench/decode_gemm_sweep.py [--rows 1 16 64 256] [--budget-s 40] [--out sweep.json]
    TRITON_INTERPRET=1 python bench/decode_gemm_sweep.py --device cpu --hidden 64 --heads 4 \\
        --kv-heads 2 --intermediate 96 --vocab 257 --rows 3 --budget-s 20  # smoke

Shapes: the five products of one decode step of the model (default the 0.89B Llama: hidden
2048, 16 / 8 heads of 128, intermediate 5632, vocab 32000), ``y = x @ W^T``, x ``[rows, K]``
bf16, W ``[N, K]`` bf16: qkv (N = (heads + 2 kv heads) x head_dim), o_proj (hidden, heads x
head_dim), gate_up (2 x intermediate, hidden), down (hidden, intermediate), LM head (vocab,
hidden); at every ``--rows`` (the decode buckets).

Timing (``common.graph_us``): ``--reps`` calls captured in ONE CUDA graph, replayed between CUDA
events, microseconds per call: what a captured decode step pays. The calls cycle over copies of
W (> 200 MB in all) so that, as in the engine (16 layers), no call finds its weight in L2.
Floor = the weight's bytes at the HBM bandwidth (``common.bandwidth``: H100 3.35 TB/s); GB/s =
weight bytes / time. Contenders: ``cublas`` (``F.linear``, what megatron's linears call) and the
skinny kernel at its current config (``skinny_gemm_config.launch_config``: env, table or the
byte-math heuristic), then a search within ``--budget-s`` seconds in all (the baselines of
every case are timed first, so a short budget still reports them). Compiling a config costs
more than timing it, and the split count is a runtime value of the kernel, so the search walks
a short list of tiles per row count (``TILES``: block_n, block_k, stages, warps; best guesses
first), compiles each once and times it on every shape at each split count that makes sense
there (``splits_for``); the row counts share the time by ``WEIGHT`` (the engine's 64 and 256
first). Each config's output is checked against torch's fp32 product rounded once (within 1
bf16 unit + 1e-3) before it is timed; a config that fails (compilation, resources, values) is
recorded and skipped.

Reports per shape and rows: floor, cuBLAS and kernel (current / best) microseconds, GB/s and
x floor; per rows the step's GEMM total (layers x the four + the head) for cuBLAS and for the
best kernel configs; and the ``skinny_gemm_config.TUNED`` entries that would apply the best
(``None`` where cuBLAS was faster: the linears then keep cuBLAS at that shape).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_llama_shape_args, bandwidth, graph_us  # noqa: E402  (one timing method)

SPLITS = (1, 2, 4, 8, 16)
# Tiles tried per row count, best guesses first: (block_n, block_k, num_stages, num_warps[,
# block_m]); each is compiled once (split_k is a runtime value) and timed on every shape at the
# split counts that make sense there (splits_for). block_m defaults to block_m_for(rows). Wide
# N tiles cut x's re-reads from L2 (rows / block_n times W's bytes). ptxas (sm_90a): every tile
# here fits in 227 KB of shared memory; the fp32 accumulators of 256 x 128 (16 warps) and
# 128 x 256 (8 warps) spill a few bytes, the others none.
TILES = {
    16: [(64, 128, 4, 4), (64, 256, 4, 4), (128, 128, 4, 4), (32, 256, 5, 4), (128, 256, 3, 8),
         (64, 128, 6, 4), (32, 128, 6, 4), (128, 64, 6, 4), (256, 64, 4, 8)],
    64: [(64, 128, 4, 4), (128, 64, 4, 8), (64, 64, 6, 4), (256, 64, 3, 8), (128, 128, 3, 8),
         (32, 128, 5, 4), (64, 256, 3, 4), (64, 128, 3, 8), (128, 64, 3, 4), (32, 64, 8, 4)],
    256: [(128, 64, 3, 8), (256, 64, 3, 16), (128, 64, 3, 8, 256), (64, 64, 3, 8),
          (128, 32, 4, 8), (128, 64, 4, 8), (64, 64, 3, 8, 256), (64, 128, 2, 8)],
}
# share of the search time per row count (the engine's batch 64 and 256 buckets first)
WEIGHT = {64: 0.35, 256: 0.35, 16: 0.15, 1: 0.15}


def shapes(args) -> list[tuple[str, int, int]]:
    """(name, N, K) of the decode step's products."""
    head_dim = args.hidden // args.heads
    return [("qkv", (args.heads + 2 * args.kv_heads) * head_dim, args.hidden),
            ("o_proj", args.hidden, args.heads * head_dim),
            ("gate_up", 2 * args.intermediate, args.hidden),
            ("down", args.hidden, args.intermediate),
            ("lm_head", args.vocab, args.hidden)]


class Case:
    """One product at ``rows``: x, several copies of W, the fp32 reference of the first."""

    def __init__(self, name, n, k, rows, dev, dtype):
        g = torch.Generator(device=dev).manual_seed(rows * 7 + n)
        self.name, self.n, self.k, self.rows = name, n, k, rows
        self.w_bytes = n * k * torch.tensor([], dtype=dtype).element_size()
        copies = 1 if dev.type != "cuda" else max(2, min(32, math.ceil(200e6 / self.w_bytes)))
        self.x = torch.randn(rows, k, device=dev, generator=g).to(dtype)
        self.ws = [(torch.randn(n, k, device=dev, generator=g) * k ** -0.5).to(dtype)
                   for _ in range(copies)]
        self.want = (self.x.float() @ self.ws[0].float().t()).to(dtype)
        self.floor_us = 1e6 * self.w_bytes / bandwidth(dev)

    def cublas(self):
        return [lambda w=w: torch.nn.functional.linear(self.x, w) for w in self.ws]

    def kernel(self, config):
        from parallel_models.rl.rollout.skinny_gemm import skinny_linear

        return [lambda w=w: skinny_linear(self.x, w, config=config) for w in self.ws]

    def excess(self, got: torch.Tensor) -> float:
        """Largest ``|got - want|`` beyond one bf16 unit in the last place of ``want``."""
        want = self.want.float()
        ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(
            want.abs().clamp_min(2.0 ** -20))))
        return ((got.float() - want).abs() - ulp).max().item()

    def check(self, got: torch.Tensor) -> None:
        err = self.excess(got)
        if not err <= 1e-3:
            raise AssertionError(f"output off torch's fp32 product by {err} beyond 1 bf16 unit")


def splits_for(n: int, k: int, rows: int, config, sms: int) -> list[int]:
    """Split counts worth timing: none, and those giving between half and 8x the SM count of
    programs with at least one K step per split."""
    tiles = -(-n // config.block_n) * -(-rows // config.block_m)
    return [s for s in SPLITS if s == 1 or (k // s >= config.block_k
                                            and sms // 2 <= tiles * s <= 8 * sms)]


def tiles_for(rows: int) -> list:
    """The TILES list of the nearest row count at or above ``rows`` as LaunchConfigs (split 1)."""
    from parallel_models.rl.rollout.skinny_gemm_config import LaunchConfig, block_m_for

    key = min((r for r in TILES if r >= rows), default=max(TILES))
    return [LaunchConfig(t[0], t[4] if len(t) > 4 else block_m_for(rows), t[1], 1, t[3], t[2])
            for t in TILES[key]]


class Search:
    """The configs tried for one case (config -> result) within a deadline."""

    def __init__(self, case: Case, dev, reps: int):
        self.case, self.dev, self.reps = case, dev, reps
        self.tried: dict = {}

    def measure(self, config, deadline: float) -> float:
        if config in self.tried:
            return self.tried[config].get("us", math.inf)
        if time.perf_counter() > deadline:
            return math.inf
        try:
            calls = self.case.kernel(config)
            self.case.check(calls[0]())
            self.tried[config] = {"us": graph_us(calls, self.dev, self.reps)}
        except Exception as exc:  # noqa: BLE001 - record it, try the next config
            self.tried[config] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        return self.tried[config].get("us", math.inf)

    def best(self):
        timed = [(r["us"], c) for c, r in self.tried.items() if "us" in r]
        return min(timed, key=lambda t: t[0])[1] if timed else None


def search_rows(searches: list, rows: int, sms: int, deadline: float) -> None:
    """Every tile of ``tiles_for(rows)`` (one compile each) on every shape at its useful split
    counts, until ``deadline``."""
    from dataclasses import replace

    for tile in tiles_for(rows):
        for search in searches:
            case = search.case
            for split in splits_for(case.n, case.k, rows, tile, sms):
                search.measure(replace(tile, split_k=split), deadline)
        if time.perf_counter() > deadline:
            return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_llama_shape_args(ap, seq=False)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--only", nargs="+", default=None, help="shape names (qkv o_proj ...)")
    ap.add_argument("--budget-s", type=float, default=40.0, help="seconds for all of it")
    ap.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    dev = torch.device(args.device)
    dtype = torch.bfloat16
    from parallel_models.rl.rollout.skinny_gemm import _sms
    from parallel_models.rl.rollout.skinny_gemm_config import launch_config

    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
           "bandwidth": bandwidth(dev), "args": vars(args), "cases": [], "errors": []}
    cases, searches = [], []
    for rows in args.rows:  # phase 1: cuBLAS and the current config of every case
        for name, n, k in shapes(args):
            if args.only and name not in args.only:
                continue
            try:
                case = Case(name, n, k, rows, dev, dtype)
                search = Search(case, dev, args.reps)
                entry = {"cublas_excess": case.excess(case.cublas()[0]()),  # (not checked)
                         "shape": name, "rows": rows, "n": n, "k": k, "w_bytes": case.w_bytes,
                         "w_copies": len(case.ws), "floor_us": case.floor_us,
                         "cublas_us": graph_us(case.cublas(), dev, args.reps)}
                start = launch_config(rows, n, k, _sms(dev))
                search.measure(start, math.inf)
                entry["current"] = start.as_env()
                cases.append(entry)
                searches.append((search, start))
            except Exception as exc:  # noqa: BLE001 - record it, run the next case
                res["errors"].append(f"{name} x{rows}: {type(exc).__name__}: {exc}")
                traceback.print_exc()
    todo = sorted({e["rows"] for e in cases}, key=lambda r: -WEIGHT.get(r, 0.1))
    for i, rows in enumerate(todo):  # phase 2: the search, the row counts by weight
        share = WEIGHT.get(rows, 0.1) / sum(WEIGHT.get(r, 0.1) for r in todo[i:])
        search_rows([s for e, (s, _) in zip(cases, searches) if e["rows"] == rows], rows,
                    _sms(dev), time.perf_counter() + share * (deadline - time.perf_counter()))
    for entry, (search, start) in zip(cases, searches):
        best = search.best() or start
        floor, ws = entry["floor_us"], entry["w_bytes"]
        cur_us = search.tried[start].get("us", math.inf)
        best_us = search.tried[best].get("us", math.inf)
        entry.update({
            "current_us": cur_us, "best": best.as_env(), "best_us": best_us,
            "cublas_over_floor": entry["cublas_us"] / floor, "current_over_floor": cur_us / floor,
            "best_over_floor": best_us / floor, "cublas_gbs": ws / entry["cublas_us"] / 1e3,
            "best_gbs": ws / best_us / 1e3, "speedup_vs_cublas": entry["cublas_us"] / best_us,
            "configs_tried": len(search.tried),
            "tried": {c.as_env(): r for c, r in search.tried.items()}})
        del search.case
    per_step = {"qkv": args.layers, "o_proj": args.layers, "gate_up": args.layers,
                "down": args.layers, "lm_head": 1}
    res["cases"] = cases
    res["step_totals"] = {}
    for rows in args.rows:
        mine = [c for c in cases if c["rows"] == rows and "best_us" in c]
        if len(mine) == len(per_step):
            res["step_totals"][rows] = {
                key: sum(per_step[c["shape"]] * c[key] for c in mine)
                for key in ("floor_us", "cublas_us", "current_us", "best_us")}
            # with the printed table: the kernel where it won, cuBLAS elsewhere
            res["step_totals"][rows]["table_us"] = sum(
                per_step[c["shape"]] * min(c["best_us"], c["cublas_us"]) for c in mine)
    res["seconds"] = time.perf_counter() - t_start
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print("| shape | rows | N x K | floor us | cuBLAS us (GB/s, x floor) | current config: us "
          "(x floor) | best config | best us (GB/s, x floor) | vs cuBLAS | configs |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in cases:
        if "best_us" not in c:
            continue
        print(f"| {c['shape']} | {c['rows']} | {c['n']}x{c['k']} | {c['floor_us']:.1f} | "
              f"{c['cublas_us']:.1f} ({c['cublas_gbs']:.0f}, {c['cublas_over_floor']:.2f}) | "
              f"{c['current']}: {c['current_us']:.1f} ({c['current_over_floor']:.2f}) | "
              f"{c['best']} | {c['best_us']:.1f} ({c['best_gbs']:.0f}, "
              f"{c['best_over_floor']:.2f}) | {c['speedup_vs_cublas']:.2f}x | "
              f"{c['configs_tried']} |")
    for rows, t in res["step_totals"].items():
        print(f"step GEMMs at rows={rows} ({args.layers} layers + head): floor {t['floor_us']:.0f} "
              f"us, cuBLAS {t['cublas_us']:.0f} us ({t['cublas_us'] / t['floor_us']:.2f}x), "
              f"kernel current {t['current_us']:.0f} us, best {t['best_us']:.0f} us "
              f"({t['best_us'] / t['floor_us']:.2f}x), with the TUNED lines below "
              f"{t['table_us']:.0f} us ({t['table_us'] / t['floor_us']:.2f}x)")
    for c in cases:  # the table entries (None: cuBLAS stays, it was faster)
        if "best_us" in c:
            value = (f"LaunchConfig({c['best'].replace(',', ', ')})"
                     if c["best_us"] < c["cublas_us"] else "None")
            print(f"TUNED[({c['rows']}, {c['n']}, {c['k']})] = {value}  # {c['shape']}: kernel "
                  f"{c['best_us']:.1f} us, cuBLAS {c['cublas_us']:.1f}")
    print(f"{res['seconds']:.1f} s")
    if res["errors"]:
        print("ERRORS:", *res["errors"], sep="\n  ")


if __name__ == "__main__":
    main()
