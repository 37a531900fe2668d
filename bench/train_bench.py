"""Side-by-side GPU throughput: ours vs transformers (SDPA) in ONE process, same weights.

    python bench/train_bench.py [--layers 16 --hidden 2048 ...] [--out results.json]

Cases (bf16, one GPU):
- ``train_full``: fwd+bwd of a full batch (micro-batch x seq, no padding), loss = token CE
  (ours: vocab-parallel log-probs; HF: its own ``labels`` loss);
- ``train_rl``: an RL-like batch (lengths uniform in [256, seq]); HF runs it padded, ours packed;
  effective tokens/s counts real tokens only;
- ``decode``: batch of prompts, greedy, N new tokens: ours (KV cache) vs ``generate``.
Timing: CUDA events, median of repeats after warm-up. TFLOP/s counts 6 x params x tokens plus
causal attention (6 x layers x hidden x sum(len^2)).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch


def timed(fn, warmup=2, iters=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def peak_gib(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-prompt", type=int, default=128)
    p.add_argument("--decode-new", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import parallel_models as pm
    from parallel_models.rl.generation import SamplingParams, generate
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits
    from transformers import AutoModelForCausalLM, LlamaConfig

    pm.init_parallel()
    dev = pm.compute_device()
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=max(8192, args.seq), architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    folder = os.path.join(tempfile.mkdtemp(), "model")
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                              attn_implementation="sdpa").to(dev)
    ours = pm.LlamaForCausalLMRmPad.from_pretrained(folder, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in hf.parameters())
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "params": n_params, "args": vars(args)}

    def flops(lengths):
        tokens = sum(lengths)
        return 6 * n_params * tokens + 6 * args.layers * args.hidden * sum(n * n for n in lengths)

    def ours_step(ids, cu):
        logits = ours(ids, cu).logits
        loss = -log_probs_from_packed_logits(logits, ids, cu).sum() / ids.numel()
        loss.backward()

    def hf_step(ids, mask):
        labels = ids.masked_fill(mask == 0, -100)
        hf(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()

    # full batch
    B, S = args.micro_batch, args.seq
    ids = torch.randint(0, args.vocab, (B, S), device=dev)
    mask = torch.ones_like(ids)
    cu = torch.arange(0, B * S + 1, S, dtype=torch.int32, device=dev)
    lengths = [S] * B
    t_hf = timed(lambda: hf_step(ids, mask))
    t_ours = timed(lambda: ours_step(ids.flatten(), cu))
    res["train_full"] = {
        "tokens": B * S, "hf_tok_s": B * S / t_hf, "ours_tok_s": B * S / t_ours,
        "hf_tflops": flops(lengths) / t_hf / 1e12, "ours_tflops": flops(lengths) / t_ours / 1e12,
        "ratio": t_hf / t_ours,
        "hf_peak_gib": peak_gib(lambda: hf_step(ids, mask)),
        "ours_peak_gib": peak_gib(lambda: ours_step(ids.flatten(), cu))}
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)

    # RL-like batch: same token count, lengths uniform in [256, seq]
    g = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < B * S * 2:
        n = int(torch.randint(256, S + 1, (1,), generator=g))
        lengths.append(n)
        total += n
    N, L = len(lengths), max(lengths)
    pids = torch.randint(0, args.vocab, (N, L), device=dev)
    pmask = torch.zeros_like(pids)
    for i, n in enumerate(lengths):
        pmask[i, :n] = 1
    packed = pm.pack_padded_batch(pids, pmask)
    t_hf = timed(lambda: hf_step(pids, pmask), warmup=1, iters=3)
    t_ours = timed(lambda: ours_step(packed.input_ids, packed.cu_seqlens), warmup=1, iters=3)
    real = sum(lengths)
    res["train_rl"] = {"sequences": N, "real_tokens": real, "padded_tokens": N * L,
                       "hf_eff_tok_s": real / t_hf, "ours_tok_s": real / t_ours,
                       "ratio": t_hf / t_ours,
                       "ours_tflops": flops(lengths) / t_ours / 1e12}
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)

    # decode
    Bd, P, new = args.decode_batch, args.decode_prompt, args.decode_new
    prompts = torch.randint(0, args.vocab, (Bd, P), device=dev)
    params = SamplingParams(max_new_tokens=new, greedy=True)
    with torch.no_grad():
        t_ours = timed(lambda: generate(ours, prompts.tolist(), params), warmup=1, iters=3)
        t_hf = timed(lambda: hf.generate(prompts, attention_mask=torch.ones_like(prompts),
                                         max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                         pad_token_id=0), warmup=1, iters=3)
    weights = n_params * 2
    kv_avg = 2 * args.layers * args.kv_heads * (args.hidden // args.heads) * 2 * Bd * (P + new / 2)
    res["decode"] = {"batch": Bd, "new_tokens": new, "hf_tok_s": Bd * new / t_hf,
                     "ours_tok_s": Bd * new / t_ours, "ratio": t_hf / t_ours,
                     "ours_ms_per_step": 1e3 * t_ours / new,
                     "hbm_floor_ms_per_step": 1e3 * (weights + kv_avg) / 3.35e12}
    print(json.dumps(res, indent=1))
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)
    pm.destroy_parallel()


if __name__ == "__main__":
    main()
