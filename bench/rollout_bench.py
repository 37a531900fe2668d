"""Rollout decode on one GPU: ours (static and continuous batching) vs the HBM floor and vs
transformers.generate (static cache), same weights, one process; and a GRPO-shaped workload.

    python bench/rollout_bench.py [--batches 64 256] [--prompt 128] [--new 256] [--hf-new 32]
                                  [--grpo-prompts 64 --grpo-n 8 --grpo-cap 2048] [--out r.json]

Model: the 0.89B Llama shape of bench/train_bench.py (hidden 2048, 16 layers, 16 heads, 8 KV
heads, intermediate 5632, vocab 32000; ``--hidden ...`` change it, e.g. for a CPU smoke run),
random weights, bf16.

- ``decode``: per batch size B, B random 128-token prompts, greedy with ``ignore_eos``:
  ``static`` = ``generation.generate`` (one CUDA graph per call); ``continuous`` =
  ``ContinuousEngine`` (bucketed CUDA graphs, one host sync per step), decode steps timed after
  the prefill step; ``hf`` = ``transformers.generate(cache_implementation="static")``, ms per new
  token over ``--hf-new`` tokens (eager; ``--hf-compile`` lets transformers compile it). HBM floor per step = (weight bytes + KV bytes read at the mean
  context, P + new/2) / bandwidth (3.35 TB/s H100, 4.8 TB/s H200). ``tokens_equal_static``: the
  fraction of rows whose continuous greedy tokens equal the static ones (bf16: batch shape can
  flip near-ties, so informational).
- ``prefix``: the ``--grpo-n`` samples of one prompt of each ``--prefix-lengths``: one prefill +
  copies of its KV (what the engine does) vs n prefills; and the copies alone.
- ``grpo``: ``--grpo-prompts`` prompts x ``--grpo-n`` samples, response lengths lognormal
  (median 256, sigma 1) capped at ``--grpo-cap``, forced with ``ignore_eos`` + per-sample
  ``max_new_tokens``: ``static`` = today's path, ``generate`` over ``--static-batch`` rows at a
  time (16 prompts x 8), each call running until its longest row finishes; ``continuous`` = each sample its own request (its own max_new_tokens), rows
  leave when done, the prompt prefilled once per group (identical prompts admitted together
  share one prefill). Reports seconds, useful tokens/s and the speedup.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from common import add_decode_shape_args, add_llama_shape_args, report, save_llama_model


def build(args, dev):
    from transformers import AutoModelForCausalLM

    import parallel_models as pm

    cfg, folder = save_llama_model(args, max_positions=8192)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                              attn_implementation="sdpa").to(dev)
    ours = pm.LlamaForCausalLMRmPad.from_pretrained(folder, dtype=torch.bfloat16)
    return cfg, hf, ours


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sync_time(fn) -> float:
    """Wall seconds of ``fn()`` (the host loop is part of what is measured), GPU synchronized."""
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def continuous_decode(ours, prompts, new, budget):
    """ms per decode step of a continuous engine running ``prompts`` to ``new`` tokens each."""
    from parallel_models.inference.continuous import ContinuousEngine
    from parallel_models.inference.sampling import SamplingParams

    params = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=new)
    eng = ContinuousEngine(ours, budget, max_rows=len(prompts), max_row_tokens=len(prompts[0]) + new)
    for warm in range(2):  # the first pass captures the bucket's graph
        reqs = [eng.submit(p, params) for p in prompts]
        eng.step()  # prefill + first decode step
        seconds = sync_time(eng.run)
    return 1e3 * seconds / (new - 2), [r.samples[0].token_ids for r in reqs]


def decode_case(args, cfg, hf, ours, dev, batch):
    from parallel_models.inference.generation import generate
    from parallel_models.inference.sampling import SamplingParams

    P, new = args.prompt, args.new
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, cfg.vocab_size, (batch, P), generator=g)
    params = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=new)
    out = {"batch": batch, "prompt": P, "new_tokens": new}
    with torch.no_grad():
        generate(ours, prompts[:, :8].tolist(), SamplingParams(greedy=True, max_new_tokens=4))
        t_static = sync_time(lambda: generate(ours, prompts.tolist(), params))
        short = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=1)
        t_prefill = sync_time(lambda: generate(ours, prompts.tolist(), short))
        static_tokens = generate(ours, prompts.tolist(), params).responses.tolist()
        out["static_ms_per_step"] = 1e3 * (t_static - t_prefill) / (new - 1)
        ms, cont_tokens = continuous_decode(ours, prompts.tolist(), new, batch * (P + new))
        out["continuous_ms_per_step"] = ms
        out["tokens_equal_static"] = sum(a == b for a, b in zip(cont_tokens, static_tokens)) / batch
        ids = prompts.to(dev)

        def hf_gen(n):
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=0,
                               cache_implementation="static",
                               disable_compile=not args.hf_compile)

        try:
            hf_gen(2)
            t1 = sync_time(lambda: hf_gen(1))
            tn = sync_time(lambda: hf_gen(args.hf_new))
            out["hf_static_cache_ms_per_step"] = 1e3 * (tn - t1) / (args.hf_new - 1)
        except Exception as exc:  # noqa: BLE001 - keep our figures if transformers fails
            out["hf_error"] = f"{type(exc).__name__}: {exc}"
            out["hf_static_cache_ms_per_step"] = float("nan")
    n_params = sum(p.numel() for p in hf.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2
                * batch * (P + new / 2))
    bw = 3.35e12 if "H100" in device_name() else 4.8e12
    out["hbm_floor_ms_per_step"] = 1e3 * (n_params * 2 + kv_bytes) / bw
    for k in ("static", "continuous"):
        out[f"{k}_over_floor"] = out[f"{k}_ms_per_step"] / out["hbm_floor_ms_per_step"]
    out["hf_over_continuous"] = out["hf_static_cache_ms_per_step"] / out["continuous_ms_per_step"]
    return out


def grpo_case(args, cfg, ours):
    from parallel_models.inference.continuous import ContinuousEngine
    from parallel_models.inference.generation import generate
    from parallel_models.inference.sampling import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, cfg.vocab_size, (args.grpo_prompts, args.prompt), generator=g)
    prompts = prompts.tolist()
    lengths = torch.distributions.LogNormal(math.log(256), 1.0).sample(
        (args.grpo_prompts * args.grpo_n,)).clamp(1, args.grpo_cap).long().tolist()
    rows = [p for p in prompts for _ in range(args.grpo_n)]
    useful = sum(lengths)
    res = {"prompts": args.grpo_prompts, "n": args.grpo_n, "cap": args.grpo_cap,
           "useful_tokens": useful, "max_length": max(lengths),
           "mean_length": useful / len(lengths)}
    with torch.no_grad():
        chunk = args.static_batch

        def run_static():  # rows in chunks; each chunk decodes until its longest row is done
            for i in range(0, len(rows), chunk):
                longest = max(lengths[i:i + chunk])
                generate(ours, rows[i:i + chunk],
                         SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=longest))

        res["static_batch"] = chunk
        res["static_s"] = sync_time(run_static)
        budget = sum(args.prompt + n for n in lengths)
        eng = ContinuousEngine(ours, budget, max_rows=len(rows),
                               max_row_tokens=args.prompt + args.grpo_cap)

        def run_continuous():
            for p, n in zip(rows, lengths):
                eng.submit(p, SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=n))
            eng.run()

        # warm: capture every bucket's graph once (a real server keeps its engine)
        for p in prompts[:1]:
            eng.submit(p, SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=4))
        eng.run()
        for b in eng.buckets:
            if eng._steps[b].use_graph and eng._steps[b].graph is None:
                _warm_bucket(eng, b)
        before, steps = eng.prefilled_prompts, eng.steps
        res["continuous_s"] = sync_time(run_continuous)
        res["continuous_prefills"] = eng.prefilled_prompts - before
        res["continuous_steps"] = eng.steps - steps
    res["static_useful_tok_s"] = useful / res["static_s"]
    res["continuous_useful_tok_s"] = useful / res["continuous_s"]
    res["speedup"] = res["static_s"] / res["continuous_s"]
    return res


def prefix_case(args, cfg, ours) -> list:
    """The n samples of one prompt: one prefill + copies of its KV into the other n-1 regions
    (what the engine does) vs n prefills (n distinct prompts of the same length, one packed
    forward); and the copies alone. One engine step each (prefill, 1 token)."""
    from parallel_models.inference.continuous import ContinuousEngine
    from parallel_models.inference.sampling import SamplingParams

    n, out = args.grpo_n, []
    one = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=1)
    for P in args.prefix_lengths:
        eng = ContinuousEngine(ours, n * (P + 1), max_rows=n)
        g = torch.Generator().manual_seed(P)
        prompts = torch.randint(0, cfg.vocab_size, (n, P), generator=g).tolist()

        def shared():
            eng.submit(prompts[0], one.model_copy(update={"n": n}))
            eng.run()

        def separate():
            for p in prompts:
                eng.submit(p, one)
            eng.run()

        times = {}
        for name, fn in (("shared", shared), ("separate", separate)):
            fn()  # warm
            times[name] = min(sync_time(fn) for _ in range(3))
        copy = min(sync_time(lambda: eng.cache.copy(0, [(P + 1) * i for i in range(1, n)], P))
                   for _ in range(3))
        out.append({"prompt": P, "n": n, "one_prefill_plus_copies_ms": 1e3 * times["shared"],
                    "n_prefills_ms": 1e3 * times["separate"], "copies_only_ms": 1e3 * copy})
    return out


def _warm_bucket(eng, size):
    """Run ``size`` one-token prompts for 3 tokens so the bucket's graph is captured."""
    from parallel_models.inference.sampling import SamplingParams

    for i in range(size):
        eng.submit([i + 1], SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=3))
    eng.run()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_llama_shape_args(ap, seq=False)
    add_decode_shape_args(ap)
    ap.add_argument("--hf-new", type=int, default=32)
    ap.add_argument("--hf-compile", action="store_true",
                    help="let transformers torch.compile its static-cache decode (minutes of "
                         "compilation per batch size; off by default to stay under 5 min)")
    ap.add_argument("--grpo-prompts", type=int, default=64)
    ap.add_argument("--grpo-n", type=int, default=8)
    ap.add_argument("--grpo-cap", type=int, default=2048)
    ap.add_argument("--static-batch", type=int, default=128,
                    help="rows per static generate call in the GRPO case (all 512 rows with "
                         "2048-token rows need ~73 GB of KV: more than an H100 holds)")
    ap.add_argument("--prefix-lengths", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--cases", default="decode,grpo,prefix")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import parallel_models as pm

    pm.init_parallel()
    dev = pm.compute_device()
    cfg, hf, ours = build(args, dev)
    res = {"device": device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    t0 = time.perf_counter()
    if "decode" in args.cases:
        res["decode"] = []
        for b in args.batches:
            try:
                res["decode"].append(decode_case(args, cfg, hf, ours, dev, b))
            except Exception as exc:  # noqa: BLE001 - report and go on to the next case
                res[f"decode_{b}_error"] = f"{type(exc).__name__}: {exc}"
                print(res[f"decode_{b}_error"])
    if "prefix" in args.cases:
        res["prefix"] = prefix_case(args, cfg, ours)
    if "grpo" in args.cases:
        del hf
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            res["grpo"] = grpo_case(args, cfg, ours)
        except Exception as exc:  # noqa: BLE001
            res["grpo_error"] = f"{type(exc).__name__}: {exc}"
    res["bench_seconds"] = time.perf_counter() - t0
    report(res, args.out)
    print("| batch | static ms/step | continuous ms/step | HF static cache ms/step | HBM floor "
          "| continuous / floor |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in res.get("decode", []):
        print(f"| {r['batch']} | {r['static_ms_per_step']:.2f} | {r['continuous_ms_per_step']:.2f}"
              f" | {r['hf_static_cache_ms_per_step']:.2f} | {r['hbm_floor_ms_per_step']:.2f} | "
              f"{r['continuous_over_floor']:.2f}x |")
    if "grpo" in res:
        r = res["grpo"]
        print(f"GRPO {r['prompts']}x{r['n']}: static {r['static_s']:.1f} s, continuous "
              f"{r['continuous_s']:.1f} s, speedup {r['speedup']:.2f}x")
    pm.destroy_parallel()


if __name__ == "__main__":
    main()
