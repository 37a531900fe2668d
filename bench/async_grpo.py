"""Asynchronous vs synchronous GRPO on two GPUs (issue 35): throughput of the same workload.

    python bench/async_grpo.py --mode both [--shape 1b] [--steps 8] [--warmup 3] [--staleness 1]
    python bench/async_grpo.py --mode both --preset long-tail [--steps 7] [--warmup 2]
    python bench/async_grpo.py --mode both --shape tiny --steps 3 --warmup 1 ...   # CPU smoke

The two runs to make on 2 GPUs (each under ~9 minutes on 2 H100s, estimated: model writing
<= 1 min, each mode's start-up ~1-1.5 min (processes, model load, CUDA graphs) plus 7 steps:
1b sync ~8 s and async ~10-15 s a step, long-tail sync ~15-20 s and async ~10-20 s; each mode
also stops at its ``--timeout`` (seconds: sync, async; the long-tail preset's 240 and 270), the
steps logged so far kept; the first is today's measured run, k = 1 without partial rollouts,
for a before / after):

    python bench/async_grpo.py --mode both --shape 1b --steps 7 --warmup 2 --timeout 200 300
    python bench/async_grpo.py --mode both --preset long-tail --steps 7 --warmup 2

Modes (each a ``parallel-models-ppo`` run of its own):
- ``sync``: colocated on both GPUs, ``torchrun --nproc-per-node 2`` at DP=2: every GPU rolls out
  its half of the batch with the in-process engine (continuous batching), then trains on it;
- ``async``: ``trainer.mode=async``: the trainer on GPU 0 (one process) starts its rollout
  server on GPU 1 (``rollout.server_devices``); the server generates the next steps' samples
  while the trainer trains (``rollout.max_staleness``, ``--staleness``; each step's request
  starts as soon as the server holds the weights it may be drawn from, earlier steps' requests
  still generating), the weights pushed after every update (``--partial``: requests in flight
  go on under the new weights instead of the push waiting for them to finish).

Workloads (the same model and prompts in both modes; a random-weight Llama written by
``bench/grpo_scale.py``'s builder; GRPO with the KL loss, one PPO epoch; ``--prompts`` prompts of
``--prompt-len`` random words per step, ``--n`` samples each):
- default (grpo_scale-style): ``--shape 1b`` (Llama-3.2-1B's shape, bf16 on CUDA; ``0.5b``;
  ``tiny`` for the CPU), 64 prompts x 8 of 256 tokens, responses up to 1024 tokens ended by stop
  tokens: up to 63 of them (``rollout.stop_token_ids``' limit of 64, less the EOS the trainer
  adds for the server) whose ``lm_head`` rows are scaled so that together they are drawn with
  probability about ``--stop-share`` per token (random logits are ~normal with variance
  0.02^2 x hidden; scaling a row by c multiplies its expected softmax weight by
  exp((c^2 - 1) var / 2)): lengths geometric-like with mean ~1 / share (rates differ between
  contexts: a heavier tail), capped at ``--max-new``;
- ``--preset long-tail``: the long tail reasoning RL sees, at the 0.5B shape (Qwen2.5-0.5B's
  layers, Llama-3's vocabulary), 64 prompts x 8 of 256 tokens. Each prompt's response length is
  fixed by a cap in its record (``data.max_new_tokens_key``, ``rollout.ignore_eos``: the lengths
  are the same in both modes and every step): lognormal, median 300 (``--response-median``),
  sigma 0.8, clipped to 16..8192 (80 % of them 100-800 tokens, ~2 % over 1,500), and in every
  step 2 of the 64 prompts (``--long-prompts``: 3.1 % of the samples) get a cap drawn uniformly
  in 4096..8192 (``--long-min`` .. ``--max-new``): responses ~600 tokens on average, a step's
  longest 5,000-8,000 (the 7 steps of the seed-0 data: means 540-640, longest 5,032-8,005). Async
  at ``max_staleness=3`` with partial rollouts (see the bound below for why 3); options
  given on the command line win.

Where the time goes, and when async can win. Let G and T be one step's generation time and its
scoring + training time on ONE GPU. Sync colocated on two GPUs takes about (G_tail + T) / 2 per
step, G_tail being generation including its tail (the last rows decoding alone, the GPU mostly
idle). Async takes max(G_stream, T + P): G_stream the server's time for a step's tokens when the
next steps' rows fill the tail, T all of training on one GPU, P the part of the weight push the
trainer waits for. Async beats sync 1.5x only if (G_tail + T) / 2 >= 1.5 (T + P), i.e. when
generation dominates the sync step (>= 2/3 of it) AND sync's generation spends >= half its time
in the tail. And one more bound: a response of L tokens must be drawn within the k steps its
staleness allows (``max_staleness``: its request starts when the server holds version
s - k, it is trained at step s), at the server's decode step time t(B) with B rows in flight:
async step >= L_max x t(B) / k. With long responses and a full server batch that is the binding
one at k = 1 (8192 tokens x ~3 ms = 25 s). Measured on 2 H200s at k = 2 (docs/PERFORMANCE.md,
session 13): async steps of ~10 s, so an 8,005-token response (~28 s at ~3.5 ms a token) had
~20 s, and its step waited 20 s for it (the median step 1.52x sync's, the five steps' total time
only 1.18x); hence k = 3 for the long-tail preset.

Reported, one JSON line per mode, over the steps after ``--warmup``: samples/s (prompts x n /
step time) and tokens/s/GPU (prompt + response tokens of the step / step time / 2 GPUs), each
as median, min, max and the steps' values, and ``overall``: over the steps' summed time;
``timing``: the median of each of the trainer's ``timing/*_s`` keys (gen: the rollout, for
async the wait for the queued samples; score: old and reference log-probs; adv; train_actor;
metrics; sync: the weight push), and for async the staleness, partial samples and idle times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from parallel_models.utils.process_tree import stop_process_tree

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_scale import SHAPES as SCALE_SHAPES  # noqa: E402
from grpo_scale import SPECIALS, build_model  # noqa: E402

SHAPES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=8192, vocab_size=128256),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, vocab_size=128256),
    "tiny": SCALE_SHAPES["tiny"],
}


# --preset long-tail: the long-tailed workload (see the module docstring); flags given on the
# command line win
PRESETS = {"long-tail": dict(shape="0.5b", prompts=64, n=8, prompt_len=256, max_new=8192,
                             caps=True, response_median=300.0, long_prompts=2, long_min=4096,
                             staleness=3, partial=True, mini_batch=128, micro_tokens=16384,
                             timeout=[240, 270])}


def apply_preset(args, parser) -> None:
    """``--preset``'s values for every option left at its default."""
    for key, value in PRESETS.get(args.preset or "", {}).items():
        if getattr(args, key) == parser.get_default(key):
            setattr(args, key, value)


def log(msg: str) -> None:
    print(f"[async_grpo {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_prompts(path: str, count: int, prompt_len: int, vocab: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(count):
            ids = torch.randint(len(SPECIALS), vocab, (prompt_len,), generator=g).tolist()
            f.write(json.dumps({"prompt": " ".join(f"t{t}" for t in ids)}) + "\n")


def build_capped_prompts(path: str, steps: int, prompts: int, prompt_len: int, vocab: int,
                         args, seed: int = 0) -> list[int]:
    """``steps`` batches of ``prompts`` records, each with its response cap (``budget``):
    lognormal around ``args.response_median`` (sigma 0.8) clipped to ``args.response_min`` ..
    ``args.max_new``, and ``args.long_prompts`` of every batch (at random places) capped
    uniformly in ``args.long_min`` .. ``args.max_new``; -> the caps."""
    import math

    g = torch.Generator().manual_seed(seed)
    out = []
    with open(path, "w") as f:
        for _ in range(steps):
            caps = torch.exp(math.log(args.response_median) + 0.8 * torch.randn(prompts,
                                                                               generator=g))
            caps = caps.round().clamp(min(args.response_min, args.max_new), args.max_new).long()
            long = torch.randperm(prompts, generator=g)[:args.long_prompts]
            low = min(args.long_min, args.max_new)
            caps[long] = torch.randint(low, args.max_new + 1, (len(long),), generator=g)
            for cap in caps.tolist():
                ids = torch.randint(len(SPECIALS), vocab, (prompt_len,), generator=g).tolist()
                f.write(json.dumps({"prompt": " ".join(f"t{t}" for t in ids),
                                    "budget": cap}) + "\n")
            out += caps.tolist()
    return out


MAX_STOP_IDS = 63  # SamplingParams.stop_token_ids' limit (64), less the EOS the trainer adds


def stop_ids(vocab: int, share: float) -> list[int]:
    """The stop tokens: ``share`` of the vocabulary past the specials, at most 63 of them."""
    count = min(MAX_STOP_IDS, max(1, round(share * vocab)))
    return list(range(len(SPECIALS), len(SPECIALS) + count))


def boost_stop_rows(folder: str, shape: dict, ids: list[int], share: float) -> float:
    """Scale the ``lm_head`` rows of ``ids`` so that they take about ``share`` of the
    probability together (see the module docstring); returns the scale."""
    import math

    from safetensors.torch import load_file, save_file

    natural = len(ids) / shape["vocab_size"]
    if share <= natural:
        return 1.0
    var = 0.02 ** 2 * shape["hidden_size"]
    scale = math.sqrt(1 + 2 * math.log(share / natural) / var)
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        name = json.load(f)["weight_map"]["lm_head.weight"]
    path = os.path.join(folder, name)
    tensors = load_file(path)
    head = tensors["lm_head.weight"].float()
    head[ids] *= scale
    tensors["lm_head.weight"] = head.to(tensors["lm_head.weight"].dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    return scale


def overrides(args, mode: str, model: str, data: str, out: str) -> list[str]:
    cuda = args.dtype == "bfloat16"
    o = [f"model.path={model}", f"model.dtype={args.dtype}", f"data.path={data}",
         f"data.max_prompt_length={args.prompt_len}", f"data.batch_size={args.prompts}",
         "data.shuffle=false", f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new}",
         "rollout.temperature=1.0", "rollout.greedy=false",
         "algorithm.adv_estimator=grpo", "critic.enable=false", "actor.use_kl_loss=true",
         "algorithm.kl_in_reward=false", "actor.ppo_epochs=1",
         f"actor.mini_batch_size={args.mini_batch}",
         f"actor.micro_batch_tokens={args.micro_tokens}",
         "actor.lr=1e-6", f"trainer.total_steps={args.steps}", "trainer.save_every=0",
         "trainer.save_hf_at_end=false", "trainer.loggers=[jsonl]", f"trainer.output_dir={out}"]
    if args.caps:  # each prompt's response length: its record's cap
        o += ["data.max_new_tokens_key=budget", "rollout.ignore_eos=true"]
    else:
        o.append("rollout.stop_token_ids=[" + ",".join(map(str, args.stop_ids)) + "]")
    if mode == "sync":
        o += ["rollout.kv_budget_tokens=auto", f"trainer.offload={str(cuda).lower()}"]
    else:
        o += ["trainer.mode=async", f"rollout.max_staleness={args.staleness}",
              f"rollout.partial={str(args.partial).lower()}",
              f"rollout.weight_push={args.weight_push}"]
        if cuda:  # the server's KV pool planned from its GPU's memory
            o += [f"rollout.server_devices={args.server_gpu}", "rollout.kv_budget_tokens=auto"]
    return o


def run_mode(args, mode: str, model: str, data: str, root: str, env: dict) -> dict:
    out = os.path.join(root, f"run_{mode}")
    train = ["-m", "parallel_models.rl.train", *overrides(args, mode, model, data, out)]
    if mode == "sync":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(args.master_port), *train]
        run_env = env
    else:
        cmd = [sys.executable, *train]
        run_env = dict(env, CUDA_VISIBLE_DEVICES=args.trainer_gpu) if args.dtype == "bfloat16" \
            else env
    timeout = args.timeout[-1] if mode == "async" else args.timeout[0]
    log(f"{mode}: {' '.join(cmd[:6])} ... (at most {timeout} s)")
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=run_env, start_new_session=True,
                            stdout=sys.stderr, stderr=sys.stderr)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:  # keep the steps logged so far
        log(f"{mode}: over {timeout} s, stopping it")
        stop_process_tree(proc)  # torchrun's ranks and the rollout server too
    rows = []
    path = os.path.join(out, "metrics.jsonl")
    if os.path.isfile(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return summary(args, mode, rows, proc.returncode, time.time() - t0)


def spread(values: list[float], overall: float | None = None) -> dict:
    """Median, min, max and the values; ``overall``: the rate over the steps' summed time (one
    slow step in five moves the median little and this one fully)."""
    if not values:
        return {}
    out = {"median": statistics.median(values), "min": min(values), "max": max(values),
           "values": values}
    if overall is not None:
        out["overall"] = overall
    return out


def summary(args, mode: str, rows: list[dict], returncode: int, wall: float) -> dict:
    """The mode's JSON line: throughput over the steps after the warm-up."""
    samples = args.prompts * args.n
    kept = rows[args.warmup:]
    step_s = [m["timing/step_s"] for m in kept]
    tokens = [samples * (args.prompt_len + m["response_length/mean"]) for m in kept]
    out = {"mode": mode, "returncode": returncode, "wall_s": round(wall, 1),
           "steps_logged": len(rows), "steps_measured": len(kept), "gpus": 2,
           "shape": args.shape, "samples_per_step": samples,
           "samples_per_s": spread([samples / s for s in step_s],
                                   samples * len(kept) / sum(step_s) if kept else None),
           "tokens_per_s_per_gpu": spread([t / s / 2 for t, s in zip(tokens, step_s)],
                                          sum(tokens) / sum(step_s) / 2 if kept else None),
           "step_s": spread(step_s),
           "response_length_mean": spread([m["response_length/mean"] for m in kept]),
           "timing": medians(kept, "timing/")}
    if mode == "async":
        out["max_staleness"], out["partial"] = args.staleness, args.partial
        for key in ("staleness_max", "partial_samples", "trainer_idle_s", "rollout_idle_s"):
            out[key] = spread([m.get(f"async/{key}", float("nan")) for m in kept])
        out["async"] = medians(kept, "async/")
    return out


def medians(rows: list[dict], prefix: str) -> dict:
    """The median over ``rows`` of each key starting with ``prefix`` (named without it)."""
    keys = sorted({k for m in rows for k in m if k.startswith(prefix)})
    return {k[len(prefix):]: round(statistics.median(m[k] for m in rows if k in m), 4)
            for k in keys}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["async", "sync", "both"], default="both")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a workload's settings for the options left at their defaults")
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the numbers")
    p.add_argument("--staleness", type=int, default=1, help="async: rollout.max_staleness")
    p.add_argument("--partial", action="store_true", help="async: rollout.partial=true")
    p.add_argument("--weight-push", choices=["stream", "group", "folder"], default="stream",
                   help="async: rollout.weight_push (group: NCCL / CUDA IPC between the "
                        "trainer and the server)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-new", type=int, default=1024)
    p.add_argument("--stop-share", type=float, default=1 / 300,
                   help="share of the vocabulary that stops a response (mean length ~1/share)")
    p.add_argument("--caps", action="store_true",
                   help="response lengths from per-prompt caps (long-tail preset) instead of "
                        "stop tokens")
    p.add_argument("--response-median", type=float, default=300.0,
                   help="--caps: median of the lognormal caps (sigma 0.8)")
    p.add_argument("--response-min", type=int, default=16, help="--caps: the shortest cap")
    p.add_argument("--long-prompts", type=int, default=0,
                   help="--caps: prompts per step capped in --long-min .. --max-new")
    p.add_argument("--long-min", type=int, default=4096, help="--caps: the long caps' low end")
    p.add_argument("--mini-batch", type=int, default=128)
    p.add_argument("--micro-tokens", type=int, default=8192)
    p.add_argument("--trainer-gpu", default="0")
    p.add_argument("--server-gpu", default="1")
    p.add_argument("--master-port", type=int, default=29533)
    p.add_argument("--timeout", type=int, nargs="+", default=[580],
                   help="seconds per mode: one for both, or sync's and async's")
    p.add_argument("--root", default=None, help="folder for the model, data and runs")
    args = p.parse_args(argv)
    apply_preset(args, p)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    args.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    shape = SHAPES[args.shape]
    args.stop_ids = stop_ids(shape["vocab_size"], args.stop_share)
    root = args.root or tempfile.mkdtemp(prefix="async_grpo_")
    model, data = os.path.join(root, "model"), os.path.join(root, "prompts.jsonl")
    if not os.path.isfile(os.path.join(model, "config.json")):
        log(f"writing the {args.shape} model to {model}")
        build_model(model, shape, "cpu", max_positions=args.prompt_len + args.max_new + 64)
        if not args.caps:
            scale = boost_stop_rows(model, shape, args.stop_ids, args.stop_share)
            log(f"{len(args.stop_ids)} stop tokens, their lm_head rows x {scale:.2f}")
    if args.caps:
        caps = build_capped_prompts(data, args.steps, args.prompts, args.prompt_len,
                                    shape["vocab_size"], args)
        log(f"response caps: median {statistics.median(caps):.0f}, mean "
            f"{statistics.mean(caps):.0f}, longest {max(caps)}, "
            f"{sum(c >= args.long_min for c in caps) / len(caps):.1%} >= {args.long_min}")
    else:
        build_prompts(data, args.prompts * args.steps, args.prompt_len, shape["vocab_size"])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    modes = ["sync", "async"] if args.mode == "both" else [args.mode]
    failed = []
    for mode in modes:
        line = run_mode(args, mode, model, data, root, env)
        print(json.dumps(line), flush=True)
        if line["returncode"] != 0:
            failed.append(mode)
    if failed:
        sys.exit(f"failed modes: {failed}")


if __name__ == "__main__":
    main()
