"""Causal attention kernels on the GPU, fwd+bwd, bf16, packed (varlen) and batched layouts.

    python bench/attention_bench.py [--out results.json]

Shapes: 16 heads (8 KV heads), head_dim 128; two regimes: 2 x 4096 (equal lengths) and an
RL-like ragged set. Every variant is checked against fp32 math attention (output and input
grads, relative L2 error) before it is timed. Tells the kernel dispatch in
``parallel_models/llama/layers/attention_kernels.py`` what to pick (issue 8).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import report, timed
from torch.nn.attention import SDPBackend, sdpa_kernel


def reference(q, k, v, lengths, g):
    """fp32 math attention per sequence: output and grads of q, k, v."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    outs, s = [], 0
    for n in lengths:
        o = F.scaled_dot_product_attention(
            q[s:s + n].transpose(0, 1), k[s:s + n].transpose(0, 1).repeat_interleave(rep, 0),
            v[s:s + n].transpose(0, 1).repeat_interleave(rep, 0), is_causal=True)
        outs.append(o.transpose(0, 1))
        s += n
    out = torch.cat(outs)
    out.backward(g.float())
    return out.detach(), q.grad, k.grad, v.grad


def rel(a, b):
    return float((a.float() - b).norm() / b.norm())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from parallel_models.llama.layers import attention_kernels as ak

    H, KV, D = 16, 8, 128
    dev = "cuda"
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    regimes = {"2x4096": [4096, 4096], "rl": [3920, 610, 2777, 1290, 4050, 2222, 3442]}
    for name, lengths in regimes.items():
        T, L = sum(lengths), max(lengths)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                          device=dev)
        torch.manual_seed(0)
        q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(T, KV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(T, KV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
        ref = reference(q, k, v, lengths, g)
        rep = H // KV

        def torch_varlen_repeat():
            from torch.nn.attention.varlen import varlen_attn
            return varlen_attn(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), cu, cu,
                               L, L, window_size=(-1, 0))

        def batched(backend, gqa):
            def run():
                B = len(lengths)
                qq = q.view(B, L, H, D).transpose(1, 2)
                kk = k.view(B, L, KV, D).transpose(1, 2)
                vv = v.view(B, L, KV, D).transpose(1, 2)
                if not gqa:
                    kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=gqa)
                return o.transpose(1, 2).reshape(T, H, D)
            return run

        variants = {
            "torch varlen_attn (flash), K/V repeated": torch_varlen_repeat,
            "aten flash varlen, native GQA": lambda: ak._flash_varlen(q, k, v, cu, L, None),
            "dispatch (varlen_causal_attention)": lambda: ak.varlen_causal_attention(q, k, v, cu, L),
        }
        if len(set(lengths)) == 1:
            for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
                for gqa in (True, False):
                    variants[f"SDPA batched {backend.name}, gqa={gqa}"] = batched(backend, gqa)
        flops = 4 * H * D * sum(n * n for n in lengths) / 2 * 3.5  # causal fwd + bwd (2.5x)
        res = {}
        for vname, fn in variants.items():
            try:
                q.grad = k.grad = v.grad = None
                out = fn()
                out.backward(g)
                errs = [rel(out, ref[0]), rel(q.grad, ref[1]), rel(k.grad, ref[2]),
                        rel(v.grad, ref[3])]
                ms = 1e3 * timed(lambda: fn().backward(g), warmup=3, iters=10)
                res[vname] = {"ms": ms, "tflops": flops / ms / 1e9, "max_rel_err": max(errs)}
            except Exception as err:  # kernel unavailable for this shape/version
                res[vname] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
        results[name] = res
    report(results, args.out)
    for name in regimes:
        print(f"\n{name}\n| variant | ms (fwd+bwd) | TFLOP/s | max rel err |\n| --- | --- | --- | --- |")
        for vname, r in results[name].items():
            if "ms" in r:
                print(f"| {vname} | {r['ms']:.2f} | {r['tflops']:.0f} | {r['max_rel_err']:.1e} |")
            else:
                print(f"| {vname} | {r['error']} | | |")


if __name__ == "__main__":
    main()
