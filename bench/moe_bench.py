"""Qwen3-MoE on one GPU: bf16 parity and fwd+bwd tokens/s, ours vs transformers, in ONE process.

    python bench/moe_bench.py [--layers 12 --hidden 2048 --experts 64 --topk 8 --expert-size 768]
                              [--seq 4096 --batch 2] [--out results.json]

A random Qwen3-MoE-shaped model (qk-norm, 64 experts top-8, expert size 768, no shared expert) is
saved once; transformers (SDPA) and ours (RmPad, TP=EP=1) load the same weights in bf16.
Parity: logits on one sequence against transformers fp32 (relative L2 over all positions), next
to transformers bf16's own distance; routing margins are whatever the random router gives, so a
few near-tied tokens may route differently in bf16 (both sides). Speed: fwd+bwd of a full batch
(loss = token cross-entropy; ours: vocab-parallel log-probs, HF: its ``labels`` loss), CUDA-event
median after warm-up, the two alternated over ``--rounds``; active-parameter TFLOP/s count
6 x (attention + top-k experts + router + head) params x tokens.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from common import add_moe_shape_args, alternate, peak_gib, report


def build_folder(args) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    folder = os.path.join(tempfile.gettempdir(), f"pm_moe_bench_{args.layers}_{args.experts}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    cfg = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         head_dim=128, intermediate_size=4 * args.hidden,
                         moe_intermediate_size=args.expert_size, num_experts=args.experts,
                         num_experts_per_tok=args.topk, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[], max_position_embeddings=max(4096, args.seq),
                         tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def active_params(args) -> int:
    attn = args.hidden * 128 * (args.heads + 2 * args.kv_heads) + args.heads * 128 * args.hidden
    experts = args.topk * 3 * args.hidden * args.expert_size
    router = args.hidden * args.experts
    return args.layers * (attn + experts + router) + args.vocab * args.hidden


def main():
    p = argparse.ArgumentParser()
    add_moe_shape_args(p)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import parallel_models as pm
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits
    from transformers import AutoModelForCausalLM

    pm.init_parallel(tensor_parallel_size=1)
    dev = pm.compute_device()
    folder = build_folder(args)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "args": vars(args)}

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    # parity on one sequence (fp32 reference, then drop it)
    n = 512
    ids = torch.randint(0, args.vocab, (1, n), device=dev)
    cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
    with torch.no_grad():
        hf32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(dev)
        ref = hf32(input_ids=ids).logits[0]
        del hf32
        torch.cuda.empty_cache()
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                  attn_implementation="sdpa").to(dev)
        ours = pm.AutoModelForCausalLM.from_pretrained(folder, rmpad=True, dtype=torch.bfloat16)
        results["ours_bf16_vs_hf_fp32_rel_err"] = rel(ours(ids[0], cu, full_vocab=True).logits, ref)
        results["hf_bf16_vs_hf_fp32_rel_err"] = rel(hf(input_ids=ids).logits[0], ref)
    del ref

    tokens = args.batch * args.seq
    batch = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    flat = batch.reshape(-1)
    cu_b = torch.arange(0, tokens + 1, args.seq, dtype=torch.int32, device=dev)

    def step_hf():
        hf(input_ids=batch, labels=batch).loss.backward()

    def step_ours():
        logits = ours(flat, cu_b).logits
        (-log_probs_from_packed_logits(logits, flat, cu_b).sum() / tokens).backward()

    timing = alternate({"hf": step_hf, "ours": step_ours}, rounds=args.rounds)
    results["gpu_state_per_round"] = timing.pop("gpu_state_per_round")
    flops = 6 * active_params(args) * tokens
    for name, t in timing.items():
        med = t["median_s"]
        results[f"{name}_step_s_median"] = med
        results[f"{name}_step_s_rounds"] = t["rounds_s"]
        results[f"{name}_step_s_spread"] = t["spread"]
        results[f"{name}_tokens_per_s"] = tokens / med
        results[f"{name}_active_tflops"] = flops / med / 1e12
    results["ours_over_hf"] = results["hf_step_s_median"] / results["ours_step_s_median"]
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    results["hf_peak_gib"] = peak_gib(step_hf)
    hf.zero_grad(set_to_none=True)
    results["ours_peak_gib"] = peak_gib(step_ours)
    report(results, args.out)
    pm.destroy_parallel()


if __name__ == "__main__":
    main()
