"""Exact mode (``rollout.exact``) on one GPU: its cost against the normal kernels, and the
rollout-vs-training log-prob difference it removes (bf16, TP=1).

    python bench/exact_mode_bench.py [--model dense|moe] [--prompts 32 --prompt-len 128
                                     --new-tokens 64] [--train-tokens 16384 --micro-tokens 8192
                                     --train-max-len 2048]
                                     [--out results.json]

Model: ``dense`` a random Llama (``--hidden 1024 --layers 8 --heads 16 --kv-heads 4
--intermediate 2816 --vocab 32000`` by default), ``moe`` the Qwen3-MoE shape of
bench/moe_bench.py (its defaults and flags: 2048 hidden, 12 layers, 64 experts top-8).
For each mode (normal, exact):

- generation: ``ContinuousEngine`` on ``--prompts`` random prompts (lengths in
  [prompt-len/2, prompt-len]), ``--new-tokens`` each, all submitted at once; ms per engine step
  (prefill included) and generated tokens/s, median of 3 runs after a warm-up (CUDA graphs and
  Triton compilation happen there);
- scoring: the actor's old-log-prob forward (``PolicyRole.log_probs``) on that batch, tokens/s;
- training: forward + backward of the policy-gradient-like loss (response log-probs and
  entropy, ``roles._response_log_probs``) over a ragged batch of ``--train-tokens`` tokens in
  microbatches of ``--micro-tokens``, tokens/s;
- mismatch: max |rollout log-prob - scoring log-prob| over the generated tokens (exact: 0).

Prints a markdown table (and writes ``--out`` as JSON).
"""

from __future__ import annotations

import argparse
import time

import torch
from common import add_moe_shape_args, ragged_batch, report, timed


def build_model(args):
    import parallel_models as pm

    if args.model == "moe":
        from moe_bench import build_folder

        folder = build_folder(args)
    else:
        from common import save_llama_model

        _, folder = save_llama_model(args, max_positions=4096)
    return pm.AutoModelForCausalLM.from_pretrained(folder, rmpad=True, dtype=torch.bfloat16)


def generation(model, prompts, new_tokens):
    from parallel_models.inference.continuous import ContinuousEngine, generation_output
    from parallel_models.inference.sampling import SamplingParams

    budget = len(prompts) * (max(map(len, prompts)) + new_tokens)
    engine = ContinuousEngine(model, budget, max_rows=len(prompts))
    params = SamplingParams(temperature=1.0, ignore_eos=True, max_new_tokens=new_tokens, seed=1)
    state = {}

    def run():
        start = engine.steps
        reqs = [engine.submit(p, params) for p in prompts]
        engine.run()
        state["steps"], state["reqs"] = engine.steps - start, reqs

    seconds = timed(run, warmup=1, iters=3)
    out = generation_output(state["reqs"])
    tokens = int(out.response_mask.sum())
    return out, {"gen_ms_per_step": 1e3 * seconds / state["steps"],
                 "gen_tokens_per_s": tokens / seconds, "gen_s": seconds}


def training_batch(args, device):
    from parallel_models.rl.roles.model_roles import make_microbatches

    lengths, ids, mask = ragged_batch(args.train_tokens, args.train_max_len, args.vocab, device,
                                      min_len=args.train_max_len // 8)
    prompt = torch.tensor([n // 4 for n in lengths])
    R = max(n - p for n, p in zip(lengths, prompt.tolist()))
    response_mask = torch.zeros(len(lengths), R, dtype=torch.long)
    for i, (n, p) in enumerate(zip(lengths, prompt.tolist())):
        response_mask[i, :n - p] = 1
    batch = dict(sequences=ids.cpu(), attention_mask=mask.cpu(), prompt_lengths=prompt,
                 response_mask=response_mask)
    mbs, _ = make_microbatches(batch, args.micro_tokens)
    return [{k: v.to(device) if torch.is_tensor(v) else v for k, v in mb.items()} for mb in mbs]


def train_step(model, mbs):
    from parallel_models.rl.roles.model_roles import _response_log_probs

    for mb in mbs:
        logits = model(mb["input_ids"], mb["cu_seqlens"], mb["position_ids"],
                       mb["max_seqlen"]).logits
        logp, ent = _response_log_probs(logits, mb, 1.0, True)
        mask = mb["response_mask"]
        (-(logp * mask).sum() - 0.01 * (ent * mask).sum()).backward()
    model.zero_grad(set_to_none=True)


def measure(model, args, prompts, mbs, exact: bool) -> dict:
    from parallel_models.llama.layers.exact import exact_mode
    from parallel_models.rl.roles.model_roles import PolicyRole

    with exact_mode(exact):
        out, row = generation(model, prompts, args.new_tokens)
        dev = next(model.parameters()).device
        batch = dict(sequences=out.sequences.to(dev), attention_mask=out.attention_mask.to(dev),
                     prompt_lengths=out.prompt_mask.sum(-1).to(dev),
                     response_mask=out.response_mask.to(dev))
        role = PolicyRole(model, None, temperature=1.0, max_tokens=args.micro_tokens)
        logp = role.log_probs(batch)
        mask = out.response_mask.bool()
        row["logprob_diff_max"] = (logp.cpu()[mask] - out.log_probs[mask]).abs().max().item()
        row["bitwise_equal"] = bool(torch.equal(logp.cpu()[mask], out.log_probs[mask]))
        scored = int(out.attention_mask.sum())
        row["score_tokens_per_s"] = scored / timed(lambda: role.log_probs(batch), 1, 3)
        tokens = sum(int(mb["cu_seqlens"][-1]) for mb in mbs)
        row["train_tokens_per_s"] = tokens / timed(lambda: train_step(model, mbs), 1, 3)
    row["mode"] = "exact" if exact else "normal"
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["dense", "moe"], default="dense")
    add_moe_shape_args(p)  # --hidden --layers --heads --kv-heads --vocab (+ the MoE ones)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--train-tokens", type=int, default=16384)
    p.add_argument("--micro-tokens", type=int, default=8192)
    p.add_argument("--train-max-len", type=int, default=2048, help="longest training sequence")
    p.add_argument("--out", default=None)
    if p.parse_known_args()[0].model == "dense":  # moe: the moe_bench shape as it stands
        p.set_defaults(hidden=1024, layers=8, heads=16, kv_heads=4)
    args = p.parse_args()

    import parallel_models as pm

    pm.init_parallel(tensor_parallel_size=1)
    t0 = time.perf_counter()
    model = build_model(args)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.prompts,),
                            generator=g).tolist()
    prompts = [torch.randint(0, args.vocab, (n,), generator=g).tolist() for n in lengths]
    mbs = training_batch(args, model.device)
    rows = [measure(model, args, prompts, mbs, exact) for exact in (False, True)]
    normal, exact = rows
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "args": vars(args), "rows": rows,
               "cost": {k: exact[k] / normal[k] for k in
                        ("gen_ms_per_step", "score_tokens_per_s", "train_tokens_per_s")},
               "wall_s": time.perf_counter() - t0}
    print(f"\nExact mode, {results['device']}, bf16, {args.model} model, {args.prompts} prompts "
          f"x ({args.prompt_len // 2}-{args.prompt_len} + {args.new_tokens}) tokens, training "
          f"{args.train_tokens} tokens in {args.micro_tokens}-token microbatches\n")
    print("| mode | gen ms/step | gen tokens/s | scoring tokens/s | training tokens/s "
          "| max abs(rollout - scoring) log-prob | bitwise |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['gen_ms_per_step']:.2f} | {r['gen_tokens_per_s']:.0f} | "
              f"{r['score_tokens_per_s']:.0f} | {r['train_tokens_per_s']:.0f} | "
              f"{r['logprob_diff_max']:.3e} | {r['bitwise_equal']} |")
    c = results["cost"]
    print(f"\nexact / normal: gen ms/step x{c['gen_ms_per_step']:.2f}, scoring tokens/s "
          f"x{c['score_tokens_per_s']:.2f}, training tokens/s x{c['train_tokens_per_s']:.2f}")
    report(results, args.out)


if __name__ == "__main__":
    main()
