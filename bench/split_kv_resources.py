"""Registers, spills and shared memory of the split-KV decode attention kernel
(``inference/split_kv_kernels.split_kernel``) compiled for sm_90 with Triton's bundled ptxas,
no GPU needed: which launch configs spill for a model shape.

    python bench/split_kv_resources.py [--heads 32 --kv-heads 8 --head-dim 128]
                                       [--configs 64,4,2 64,8,2 32,4,2] [--rope both]

One JSON line per (config ``block_n,num_warps,num_stages``, RoPE in the kernel or not; one
split, bf16, the FP8 engines' dependent launch on): ``registers``, ``spill_bytes`` and
``shared`` bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # (the compiled kernel, not the interpreter's)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_gemm_sweep import register_usage  # noqa: E402  (imports no triton at load)


def resources(heads: int, kv_heads: int, dim: int, block_n: int, warps: int, stages: int,
              rope: bool) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from parallel_models.inference import split_kv_kernels as K

    types = dict(Q="*bf16", KNew="*bf16", VNew="*bf16", KPool="*bf16", VPool="*bf16",
                 Offsets="*i64", Used="*i32", Back="*i32", Out="*bf16", PartOut="*fp32",
                 PartLse="*fp32", Cos="*bf16", Sin="*bf16", KScale="*fp32", VScale="*fp32",
                 scale="fp32")
    group = heads // kv_heads
    consts = dict(G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=dim,
                  BLOCK_N=block_n, SPLIT=512, NUM_SPLITS=1, H=heads, IEEE=False,
                  RUNTIME_LOOP=True, ROPE=rope, MAX_BACK=0, FP8_KV=False, INTERPRETED=False,
                  PDL=True)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32")
           for n in K.split_kernel.arg_names}
    k = triton.compile(ASTSource(K.split_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    return {**register_usage(k), "shared": k.metadata.shared}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--configs", nargs="+", default=["64,4,2", "64,8,2", "32,4,2"])
    ap.add_argument("--rope", choices=("both", "on", "off"), default="both")
    args = ap.parse_args(argv)
    ropes = {"both": (True, False), "on": (True,), "off": (False,)}[args.rope]
    for text in args.configs:
        block_n, warps, stages = (int(v) for v in text.split(","))
        for rope in ropes:
            row = {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                   "block_n": block_n, "num_warps": warps, "num_stages": stages, "rope": rope,
                   **resources(args.heads, args.kv_heads, args.head_dim, block_n, warps,
                               stages, rope)}
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
