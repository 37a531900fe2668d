"""The report of a ``bench/grpo_scale.py`` run: per logged step of the trainer's
``metrics.jsonl``, each phase's seconds, peak / reserved GiB, allocator retries, tokens/s/GPU and
TFLOP/s (MFU against the H200's dense bf16 peak); the step's tokens counted as NeMo-RL counts
them; the markdown table of the last step and the run's one JSON line (median and spread of the
steps after the first)."""

from __future__ import annotations

import json
import os
import statistics

H200_BF16_DENSE_TFLOPS = 989.0


def flops_per_token_pass(shape: dict) -> float:
    """Multiplying parameters of one token's forward (x 2 FLOPs each): the linears and the head."""
    H, L = shape["hidden_size"], shape["num_hidden_layers"]
    kv = H // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = H * (2 * H + 2 * kv) + 3 * H * shape["intermediate_size"]
    return 2.0 * (L * per_layer + shape["vocab_size"] * H)


def attention_flops(shape: dict, lengths: list[int]) -> float:
    """Causal attention of one forward over sequences of ``lengths`` (QK^T and PV, half)."""
    H, L = shape["hidden_size"], shape["num_hidden_layers"]
    return sum(2.0 * n * n * H * L for n in lengths)


def step_report(shape, metrics: dict, seq_lengths: list[int], response_tokens: int,
                gpus: int, matmul_peak: float | None) -> dict:
    """Per phase: seconds, peak GiB, tokens/s/GPU; MFU of scoring and the actor update."""
    tokens = sum(seq_lengths)
    fwd = flops_per_token_pass(shape) * tokens + attention_flops(shape, seq_lengths)
    work = {"gen": (response_tokens, None), "score": (2 * tokens, 2 * fwd),
            "train_actor": (tokens, 3 * fwd), "train_critic": (tokens, 3 * fwd)}
    out = {"tokens": tokens, "response_tokens": response_tokens, "phases": {}}
    for key, value in metrics.items():
        if not (key.startswith("timing/") and key.endswith("_s")) or key == "timing/step_s":
            continue
        phase = key[len("timing/"):-2]
        if value < 1e-3:  # a phase that did nothing (e.g. the critic's update without a critic)
            continue
        row = {"s": value, "peak_gib": metrics.get(f"memory/{phase}_peak_gib"),
               "reserved_gib": metrics.get(f"memory/{phase}_reserved_gib"),
               "alloc_retries": metrics.get(f"memory/{phase}_alloc_retries")}
        count, flops = work.get(phase, (None, None))
        if count and value > 0:
            row["tokens_per_s_per_gpu"] = count / value / gpus
        if flops and value > 0:
            tflops = flops / value / gpus / 1e12
            row["tflops_per_gpu"] = tflops
            row["mfu_h200_dense"] = tflops / H200_BF16_DENSE_TFLOPS
            if matmul_peak:
                row["share_of_matmul_peak"] = tflops / matmul_peak
        out["phases"][phase] = row
    out["step_s"] = metrics["timing/step_s"]
    out["nemo_rl_tokens_per_s_per_gpu"] = tokens / out["step_s"] / gpus
    return out


def read_steps(args, shape: dict, result: dict, metrics_path: str, caps: list[int],
               prompt_len: int) -> dict:
    """``result`` with its ``steps``: each logged step of the run's ``metrics.jsonl`` reported
    per phase (the step's samples are the prompts' response caps, in order)."""
    rows = []
    if os.path.isfile(metrics_path):
        with open(metrics_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    result["steps"] = []
    for step, m in enumerate(rows):
        batch_caps = caps[step * args.prompts:(step + 1) * args.prompts]
        lengths = [prompt_len + c for c in batch_caps for _ in range(args.n)]
        response = sum(batch_caps) * args.n
        r = step_report(shape, m, lengths, response, 2, args.matmul_peak)
        r["response_length_mean_logged"] = m.get("response_length/mean")
        r["reward_mean"] = m.get("reward/mean")
        result["steps"].append(r)
    return result


def print_table(result: dict) -> None:
    if not result["steps"]:
        return
    last = result["steps"][-1]
    print(f"\n{result['layout']}, step {len(result['steps'])}: {last['step_s']:.1f} s, "
          f"{last['tokens']} tokens ({last['response_tokens']} generated), "
          f"NeMo-RL tokens/s/GPU {last['nemo_rl_tokens_per_s_per_gpu']:.0f}")
    print("| phase | s | peak GiB | reserved GiB | allocator retries | tokens/s/GPU | TFLOP/s/GPU "
          "| MFU (989) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for phase, r in last["phases"].items():
        def fmt(key, spec):
            return format(r[key], spec) if r.get(key) is not None else ""
        print(f"| {phase} | {r['s']:.2f} | {fmt('peak_gib', '.1f')} | "
              f"{fmt('reserved_gib', '.1f')} | {fmt('alloc_retries', '.0f')} | "
              f"{fmt('tokens_per_s_per_gpu', '.0f')} | {fmt('tflops_per_gpu', '.0f')} | "
              f"{fmt('mfu_h200_dense', '.1%')} |")


def case_line(result: dict, args) -> dict:
    """The run's one JSON line: per step its time, NeMo-RL tokens/s/GPU and each phase's seconds
    and peak GiB; the median and spread of the steps after the first (warm-up)."""
    steps = result["steps"]
    timed = [s["step_s"] for s in steps[1:]] or [s["step_s"] for s in steps]
    return {"case": f"{args.shape}-{result['layout']}-{'ppo_critic' if args.critic else 'grpo'}",
            "returncode": result["returncode"], "steps": len(steps),
            "host_rss_peak_gib": result.get("host_rss_peak_gib"),
            "host_available_min_gib": result.get("host_available_min_gib"),
            "median_step_s": statistics.median(timed) if timed else None,
            "spread_step_s": [min(timed), max(timed)] if timed else None,
            "nemo_rl_tokens_per_s_per_gpu": [s["nemo_rl_tokens_per_s_per_gpu"] for s in steps],
            "phases": [{k: {"s": v["s"], "peak_gib": v["peak_gib"]}
                        for k, v in s["phases"].items()} for s in steps]}
