"""Side-by-side GPU throughput: ours vs transformers (SDPA) in ONE process, same weights.

    python bench/train_bench.py [--layers 16 --hidden 2048 ...] [--cases train_full,decode]
                                [--out results.json] [--profile DIR]

Cases (bf16, one GPU):
- ``train_full``: fwd+bwd of a full batch (micro-batch x seq, no padding), loss = token CE
  (ours: vocab-parallel log-probs; HF: its own ``labels`` loss);
- ``train_rl``: an RL-like batch (lengths uniform in [256, seq]); HF runs it padded, ours packed;
  effective tokens/s counts real tokens only;
- ``decode``: batch of prompts, greedy, N new tokens: ours (KV cache) vs ``generate``.
Timing: CUDA events, median of repeats after warm-up. TFLOP/s counts 6 x params x tokens plus
causal attention (6 x layers x hidden x sum(len^2)); params = all but the input embedding. ``--profile DIR`` also writes the CUDA
kernels of one step of each side (self time) as text tables.
"""

from __future__ import annotations

import argparse
import os

import torch
from common import (add_llama_shape_args, kernel_table, matmul_peak_tflops, peak_gib,
                    ragged_batch, report, save_llama_model, timed)


def check_against_hf(hf, ours, folder, args, dev) -> dict:
    """Logits on one sequence against transformers in fp32 (the reference), relative L2 error
    over all positions: ours fp32; ours bf16 (the benchmarked model, fused kernels on) next to
    transformers bf16 (how far bf16 itself lands from fp32)."""
    import parallel_models as pm
    from transformers import AutoModelForCausalLM

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    n = min(args.seq, 1024)
    ids = torch.randint(0, args.vocab, (1, n), device=dev)
    cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
    out = {}
    with torch.no_grad():
        hf32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                    attn_implementation="sdpa").to(dev)
        ref = hf32(input_ids=ids).logits[0]
        ours32 = pm.LlamaForCausalLMRmPad.from_pretrained(folder, dtype=torch.float32)
        got32 = ours32(ids[0], cu, full_vocab=True).logits
        out["ours_fp32_vs_hf_fp32_rel_err"] = rel(got32, ref)
        out["ours_fp32_vs_hf_fp32_max_abs_err"] = float((got32 - ref).abs().max())
        out["ours_bf16_vs_hf_fp32_rel_err"] = rel(ours(ids[0], cu, full_vocab=True).logits, ref)
        out["hf_bf16_vs_hf_fp32_rel_err"] = rel(hf(input_ids=ids).logits[0], ref)
    # fp32 loss and gradients through the fused kernels and the fused vocab-parallel loss
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits

    hf_loss = hf32(input_ids=ids, labels=ids).loss
    hf_loss.backward()
    logits = ours32(ids[0], cu).logits
    ours_loss = -log_probs_from_packed_logits(logits, ids[0], cu).sum() / (n - 1)
    ours_loss.backward()
    out["fp32_loss_abs_diff"] = float((ours_loss - hf_loss).abs())
    out["fp32_lm_head_grad_rel_err"] = rel(ours32.lm_head.weight.grad, hf32.lm_head.weight.grad)
    out["fp32_embedding_grad_rel_err"] = rel(ours32.model.embed_tokens.weight.grad,
                                             hf32.model.embed_tokens.weight.grad)
    out["fp32_final_norm_grad_rel_err"] = rel(ours32.model.norm.weight.grad,
                                              hf32.model.norm.weight.grad)
    del hf32, ours32
    torch.cuda.empty_cache()
    return out


def main():
    p = argparse.ArgumentParser()
    add_llama_shape_args(p)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-prompt", type=int, default=128)
    p.add_argument("--decode-new", type=int, default=512)
    p.add_argument("--cases", default="train_full,train_rl,decode")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None)
    args = p.parse_args()
    cases = set(args.cases.split(","))

    import parallel_models as pm
    from parallel_models.utils import gpu_compile
    from parallel_models.inference.generation import SamplingParams, generate
    from parallel_models.options import options_override
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits
    from transformers import AutoModelForCausalLM

    pm.init_parallel()
    dev = pm.compute_device()
    cfg, folder = save_llama_model(args, max_positions=max(8192, args.seq))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                              attn_implementation="sdpa").to(dev)
    ours = pm.LlamaForCausalLMRmPad.from_pretrained(folder, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in hf.parameters())
    # model FLOPs count the parameters that multiply (not the input embedding lookup)
    n_matmul = n_params - hf.get_input_embeddings().weight.numel()
    peak = matmul_peak_tflops(dev)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "params": n_params, "matmul_peak_tflops": peak, "args": vars(args)}
    table = []

    def flops(lengths):
        tokens = sum(lengths)
        return 6 * n_matmul * tokens + 6 * args.layers * args.hidden * sum(n * n for n in lengths)

    def ours_step(ids, cu):
        logits = ours(ids, cu).logits
        loss = -log_probs_from_packed_logits(logits, ids, cu).sum() / ids.numel()
        loss.backward()

    def hf_step(ids, mask):
        labels = ids.masked_fill(mask == 0, -100)
        hf(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()

    def clear_grads():
        hf.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)

    B, S = args.micro_batch, args.seq
    res["correctness"] = check_against_hf(hf, ours, folder, args, dev)

    def ours_unfused(fn):
        gpu_compile.set_compilation(False)
        try:
            return timed(fn, warmup=1, iters=3)
        finally:
            gpu_compile.set_compilation(True)

    if "train_full" in cases:
        ids = torch.randint(0, args.vocab, (B, S), device=dev)
        mask = torch.ones_like(ids)
        cu = torch.arange(0, B * S + 1, S, dtype=torch.int32, device=dev)
        f = flops([S] * B)
        t_hf = timed(lambda: hf_step(ids, mask))
        t_ours = timed(lambda: ours_step(ids.flatten(), cu))
        r = res["train_full"] = {
            "tokens": B * S, "hf_tok_s": B * S / t_hf, "ours_tok_s": B * S / t_ours,
            "hf_tflops": f / t_hf / 1e12, "ours_tflops": f / t_ours / 1e12, "ratio": t_hf / t_ours,
            "hf_peak_gib": peak_gib(lambda: hf_step(ids, mask)),
            "ours_peak_gib": peak_gib(lambda: ours_step(ids.flatten(), cu)),
            "ours_unfused_tok_s": B * S / ours_unfused(lambda: ours_step(ids.flatten(), cu))}
        table.append((f"fwd+bwd {B}x{S}", r["hf_tok_s"], r["hf_tflops"], r["hf_peak_gib"],
                      r["ours_tok_s"], r["ours_tflops"], r["ours_peak_gib"], r["ratio"]))
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
            kernel_table(lambda: ours_step(ids.flatten(), cu), f"{args.profile}/ours_train.txt")
            kernel_table(lambda: hf_step(ids, mask), f"{args.profile}/hf_train.txt")
        clear_grads()

    if "train_rl" in cases:  # same token count as 2 full batches, lengths uniform in [256, S]
        lengths, pids, pmask = ragged_batch(B * S * 2, S, args.vocab, dev)
        N, L = pids.shape
        packed = pm.pack_padded_batch(pids, pmask)
        f = flops(lengths)
        t_hf = timed(lambda: hf_step(pids, pmask), warmup=1, iters=3)
        t_ours = timed(lambda: ours_step(packed.input_ids, packed.cu_seqlens), warmup=1, iters=3)
        real = sum(lengths)
        r = res["train_rl"] = {
            "sequences": N, "real_tokens": real, "padded_tokens": N * L,
            "hf_eff_tok_s": real / t_hf, "ours_tok_s": real / t_ours, "ratio": t_hf / t_ours,
            "hf_tflops": f / t_hf / 1e12, "ours_tflops": f / t_ours / 1e12,
            "hf_peak_gib": peak_gib(lambda: hf_step(pids, pmask)),
            "ours_peak_gib": peak_gib(lambda: ours_step(packed.input_ids, packed.cu_seqlens)),
            "ours_unfused_tok_s": real / ours_unfused(
                lambda: ours_step(packed.input_ids, packed.cu_seqlens))}
        table.append((f"fwd+bwd RL batch ({N} seqs)", r["hf_eff_tok_s"], r["hf_tflops"],
                      r["hf_peak_gib"], r["ours_tok_s"], r["ours_tflops"], r["ours_peak_gib"],
                      r["ratio"]))
        clear_grads()

    if "decode" in cases:
        Bd, P, new = args.decode_batch, args.decode_prompt, args.decode_new
        prompts = torch.randint(0, args.vocab, (Bd, P), device=dev)
        params = SamplingParams(max_new_tokens=new, greedy=True)

        def hf_generate(n):
            return hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=0)

        with torch.no_grad():
            t_ours = timed(lambda: generate(ours, prompts.tolist(), params), warmup=1, iters=3)
            t_hf = timed(lambda: hf_generate(new), warmup=1, iters=3)
            # the same decode without CUDA graphs: its speed, and identical tokens
            short = SamplingParams(max_new_tokens=min(new, 64), greedy=True)
            with options_override(cuda_graphs=False):
                t_eager = timed(lambda: generate(ours, prompts.tolist(), short), warmup=1,
                                iters=2)
                eager_tokens = generate(ours, prompts.tolist(), short).responses
            graph_tokens = generate(ours, prompts.tolist(), short).responses
            graphs_equal_eager = bool(torch.equal(eager_tokens, graph_tokens))
            if args.profile:
                short = SamplingParams(max_new_tokens=16, greedy=True)
                kernel_table(lambda: generate(ours, prompts.tolist(), short),
                             f"{args.profile}/ours_decode16.txt")
                kernel_table(lambda: hf_generate(16), f"{args.profile}/hf_decode16.txt")
        weights = n_params * 2
        kv_avg = 2 * args.layers * args.kv_heads * (args.hidden // args.heads) * 2 * Bd * (P + new / 2)
        bw = 3.35e12 if "H100" in res["device"] else 4.8e12
        r = res["decode"] = {
            "batch": Bd, "new_tokens": new, "hf_tok_s": Bd * new / t_hf,
            "ours_tok_s": Bd * new / t_ours, "ratio": t_hf / t_ours,
            "ours_ms_per_step": 1e3 * t_ours / new, "hf_ms_per_step": 1e3 * t_hf / new,
            "ours_eager_ms_per_step": 1e3 * t_eager / short.max_new_tokens,
            "graph_tokens_equal_eager": graphs_equal_eager,
            "dynamo_stats": {k: v for k, v in torch._dynamo.utils.counters["stats"].items()},
            "hbm_floor_ms_per_step": 1e3 * (weights + kv_avg) / bw}
        table.append((f"decode b{Bd} {P}+{new}", r["hf_tok_s"], float("nan"), float("nan"),
                      r["ours_tok_s"], float("nan"), float("nan"), r["ratio"]))

    report(res, args.out)
    print("correctness vs transformers:", res["correctness"])
    print(f"\n{res['device']}, matmul peak {peak:.0f} TFLOP/s, {n_params / 1e9:.2f}B params")
    print("| case | HF tok/s | HF TFLOP/s (% peak) | HF GiB | ours tok/s | ours TFLOP/s (% peak) "
          "| ours GiB | ours/HF |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, ht, hf_tf, hg, ot, o_tf, og, ratio in table:
        print(f"| {name} | {ht:,.0f} | {hf_tf:.0f} ({100 * hf_tf / peak:.0f}%) | {hg:.1f} | {ot:,.0f} "
              f"| {o_tf:.0f} ({100 * o_tf / peak:.0f}%) | {og:.1f} | {ratio:.2f}x |")
    pm.destroy_parallel()


if __name__ == "__main__":
    main()
