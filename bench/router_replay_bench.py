"""Router replay on one GPU (bf16, the Qwen3-MoE shape of bench/moe_bench.py): how far the
training forward of an MoE policy is from its rollout, with and without router replay.

    python bench/router_replay_bench.py [--prompts 64 --prompt-len 128 --new-tokens 128]
                                        [--micro-tokens 4096 16384] [--out results.json]

The rollout engine (CUDA graphs on) samples one response per random prompt (temperature 1) and
records its log-probs and the routes of every prompt and generated token (``record_routes``).
The actor's old-log-prob forward (``PolicyRole.log_probs``, packed microbatches of each
``--micro-tokens`` budget) then scores the same tokens:

- ``off``: the router chooses by itself; ``R3``: the rollout's routes are replayed;
- route mismatch: share of (token, MoE layer) routes the training forward would choose
  differently from the rollout (measured before replay, so the same for off and R3);
- |rollout - training| log-prob of the sampled tokens (mean, max) and the K3 KL estimate;
- forward time of the scoring (median of 3, CUDA events) and generation time with and without
  recording routes.

Prints a markdown table (and writes ``--out`` as JSON).
"""

from __future__ import annotations

import argparse

import torch
from common import add_moe_shape_args, report, timed
from moe_bench import build_folder


def mismatch_row(role, batch, replay: bool) -> dict:
    from parallel_models.rl.algorithms.mismatch import rollout_mismatch_metrics

    batch.old_log_probs = role.log_probs(batch, replay=replay)
    row = rollout_mismatch_metrics(batch, role.route_session)
    row["forward_s"] = timed(lambda: role.log_probs(batch, replay=replay), warmup=1, iters=3)
    return row


def main():
    p = argparse.ArgumentParser()
    add_moe_shape_args(p)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--micro-tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import parallel_models as pm
    from parallel_models.rl.data.batch import RolloutBatch
    from parallel_models.rl.roles.model_roles import PolicyRole
    from parallel_models.inference.engine import RolloutEngine
    from parallel_models.inference.sampling import SamplingParams
    from parallel_models.utils import routes as route_utils

    pm.init_parallel(tensor_parallel_size=1)
    folder = build_folder(args)
    cls = pm.get_model_class(pm.registry.architecture_of(folder), "causal_lm", rmpad=True)
    model = cls.from_pretrained(folder, dtype=torch.bfloat16)
    model.eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.prompts,),
                            generator=g).tolist()
    prompts = [torch.randint(0, args.vocab, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=1,
                            ignore_eos=True)
    engine = RolloutEngine(model)
    out = engine.generate(prompts, params, record_routes=True)
    batch = RolloutBatch(sequences=out.sequences, attention_mask=out.attention_mask,
                         prompt_lengths=out.prompt_mask.sum(-1), response_mask=out.response_mask,
                         group_index=torch.arange(len(prompts)),
                         rollout_log_probs=out.log_probs, routes=out.routes)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "args": vars(args), "rows": [],
               "generate_s": timed(lambda: engine.generate(prompts, params), warmup=1, iters=3),
               "generate_recording_s": timed(
                   lambda: engine.generate(prompts, params, record_routes=True),
                   warmup=1, iters=3)}
    own = {}
    for budget in args.micro_tokens:
        role = PolicyRole(model, None, temperature=1.0, max_tokens=budget)
        for mode in ("off", "R3"):
            row = mismatch_row(role, batch, replay=mode == "R3")
            row.update(mode=mode, micro_tokens=budget)
            results["rows"].append(row)
        role.log_probs(batch, record=True)
        own[budget] = route_utils.expand(role.recorded_routes)
    a, b = args.micro_tokens[0], args.micro_tokens[-1]
    differ, compared = route_utils.share_differing(own[a], own[b])
    results["training_routes_differ_between_budgets"] = differ / max(compared, 1)

    print(f"\nRouter replay, {results['device']}, bf16, {args.layers} layers, {args.experts} "
          f"experts top-{args.topk}, {args.prompts} prompts x ({args.prompt_len // 2}-"
          f"{args.prompt_len} + {args.new_tokens}) tokens\n")
    print("| replay | microbatch tokens | route mismatch | logprob diff mean | logprob diff max "
          "| K3 KL | scoring forward s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results["rows"]:
        print(f"| {r['mode']} | {r['micro_tokens']} | {r.get('router/route_mismatch', 0):.4f} | "
              f"{r['rollout/logprob_diff_mean']:.3e} | {r['rollout/logprob_diff_max']:.3e} | "
              f"{r['rollout/k3_kl']:.3e} | {r['forward_s']:.3f} |")
    print(f"\ntraining forward's own routes, {a} vs {b} microbatch tokens: "
          f"{results['training_routes_differ_between_budgets']:.4f} differ")
    print(f"generation: {results['generate_s']:.3f} s, recording routes "
          f"{results['generate_recording_s']:.3f} s")
    report(results, args.out)


if __name__ == "__main__":
    main()
