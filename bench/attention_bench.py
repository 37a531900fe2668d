"""Causal attention kernels on the GPU, fwd+bwd, bf16: varlen_attn (packed) vs SDPA backends.

    python bench/attention_bench.py

Shapes: 16 heads (8 KV heads), head_dim 128, 2 sequences of 4096 and an RL-like set of lengths.
Tells which kernel the packed path should use per sequence-length regime (issue 8).
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, iters=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def main():
    from torch.nn.attention.varlen import varlen_attn

    H, KV, D = 16, 8, 128
    dev = "cuda"
    out = {}
    for name, lengths in {"2x4096": [4096, 4096], "rl": [3920, 610, 2777, 1290, 4050, 2222, 3442]}.items():
        T = sum(lengths)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(T, KV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(T, KV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)

        import inspect

        gqa = "enable_gqa" in inspect.signature(varlen_attn).parameters

        def varlen():
            kk, vv = (k, v) if gqa else (k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1))
            kw = {"enable_gqa": True} if gqa else {}
            o = varlen_attn(q, kk, vv, cu, cu, max(lengths), max(lengths), window_size=(-1, 0), **kw)
            o.backward(g)

        def sdpa(backend):
            def run():
                with sdpa_kernel(backend):
                    outs = []
                    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
                        o = F.scaled_dot_product_attention(
                            q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None],
                            v[s:e].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
                        outs.append(o[0].transpose(0, 1))
                    torch.cat(outs).backward(g)
            return run

        res = {"varlen_attn_ms": timed(varlen), "varlen_native_gqa": gqa}
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION):
            try:
                res[f"sdpa_{backend.name.lower()}_ms"] = timed(sdpa(backend))
            except Exception as err:  # backend unavailable for this shape
                res[f"sdpa_{backend.name.lower()}_ms"] = f"n/a ({type(err).__name__})"
        flops = 4 * H * D * sum(n * n for n in lengths) / 2 * 3.5  # fwd + bwd (2.5x) causal
        res["varlen_tflops"] = flops / (res["varlen_attn_ms"] / 1e3) / 1e12
        out[name] = res
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
