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
``--decode-batch B`` (0 = skip) adds MoE decode: ms per step of the continuous engine (B rows,
``--decode-prompt`` + ``--decode-new`` tokens, greedy) for three variants: megatron-core's
dispatcher with the expert weights stacked per forward (the state before on-device dispatch;
its CUDA-graph capture fails, so it decodes eagerly), on-device dispatch (graphs) with stacked
weights, and on-device dispatch with the packed weights read in place (the default); beside the
HBM floor (all weights + the KV read at the mean context, / 3.35 TB/s H100, 4.8 TB/s H200).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from common import add_moe_shape_args, alternate, peak_gib, report, timed


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


def decode_variants(model, args) -> dict:
    """ms per decode step of each variant (see the module doc) and the HBM floor."""
    import warnings

    from parallel_models.inference.continuous import ContinuousEngine
    from parallel_models.inference.sampling import SamplingParams
    from parallel_models.options import options_override

    B, P, new = args.decode_batch, args.decode_prompt, args.decode_new
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab, (B, P), generator=g).tolist()
    variants = {"megatron_dispatch_stacked": (False, False),
                "device_dispatch_stacked": (True, False), "device_dispatch_packed": (True, True)}
    out = {}
    for name, (dispatch, packed) in variants.items():
        eng = ContinuousEngine(model, B * (P + new + 16), max_rows=B)

        def run(n, eng=eng):
            for p in prompts:
                eng.submit(p, SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=n))
            eng.run()

        with torch.no_grad(), warnings.catch_warnings(record=True) as caught, \
                options_override(moe_device_dispatch=dispatch, moe_packed_experts=packed):
            warnings.simplefilter("always")
            short = timed(lambda: run(4), warmup=1, iters=3)
            long = timed(lambda: run(4 + new), warmup=0, iters=3)
        out[name] = {"ms_per_step": 1e3 * (long - short) / new,
                     "graphs": any(s.graph is not None for s in eng._steps.values()),
                     "capture_failed": any("capture" in str(w.message) for w in caught)}
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = 2 * args.layers * args.kv_heads * 128 * 2 * B * (P + new / 2)
    bw = 3.35e12 if "H100" in torch.cuda.get_device_name() else 4.8e12
    out["hbm_floor_ms_per_step"] = 1e3 * (params + kv) / bw
    for name in variants:
        out[name]["over_floor"] = out[name]["ms_per_step"] / out["hbm_floor_ms_per_step"]
    return out


def main():
    p = argparse.ArgumentParser()
    add_moe_shape_args(p)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-prompt", type=int, default=128)
    p.add_argument("--decode-new", type=int, default=64)
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
    ours.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    if args.decode_batch:
        results["decode"] = decode_variants(ours, args)
    report(results, args.out)
    pm.destroy_parallel()


if __name__ == "__main__":
    main()
