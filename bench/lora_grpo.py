"""GRPO with LoRA rank 64 vs full fine-tuning on one GPU (issue 36 item 6): step time and peak
memory per mode, one JSON line each.

    python bench/lora_grpo.py --shape 8b --modes lora full      # one H100 (80 GB)
    python bench/lora_grpo.py --shape 1.5b --modes lora full    # where full fine-tuning fits
    python bench/lora_grpo.py --shape tiny --steps 1 ...         # the CPU smoke (tests)

Each mode is the trainer's own run (``python -m parallel_models.rl.train``, one process, one
GPU) on a random-weight bf16 Llama of the shape (written once, with a word-level tokenizer and
prompts of exactly ``--prompt-len`` tokens whose response caps are long-tailed:
``bench/grpo_scale.py``'s builders), ``rollout.ignore_eos`` so every response reaches its cap:

- ``lora``: ``actor.lora.rank=64`` (alpha 128, all-linear): the base frozen, the optimizer holds
  the adapters, the reference is the actor with its adapters off (one copy of the weights);
- ``full``: full fine-tuning, with the reference a second copy of the model.

GRPO: ``--n`` samples per prompt, the KL loss to the reference, one PPO epoch in minibatches of
``--mini-batch``. A mode that does not fit (out of memory) still gives its line, with
``"fits": false`` and the end of its log. Reported per mode: the last step's time and per-phase
times, peak GiB (the trainer's ``memory/*_peak_gib``, the largest over phases), the trainable
parameter count (LoRA: the adapters', from the trainer's log), and the run's exit code. Step 1
includes graph capture and warm-up: the line reports the last step, every step is in ``steps``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grpo_scale import SHAPES as SCALE_SHAPES  # noqa: E402
from grpo_scale import build_data, build_model  # noqa: E402

SHAPES = SCALE_SHAPES  # 8b, tiny and Qwen2.5-1.5B / 0.5B's sizes as Llamas
MODES = ("lora", "full")


def log(msg: str) -> None:
    print(f"[lora_grpo {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def overrides(args, mode: str, model: str, data: str, out: str) -> list[str]:
    o = [f"model.path={model}", f"model.dtype={args.dtype}", f"data.path={data}",
         f"data.max_prompt_length={args.prompt_len}", f"data.batch_size={args.prompts}",
         "data.shuffle=false", "data.max_new_tokens_key=budget", f"rollout.n={args.n}",
         f"rollout.max_new_tokens={args.max_new}", "rollout.ignore_eos=true",
         f"rollout.max_batch_rows={args.prompts * args.n}",
         "algorithm.adv_estimator=grpo", "critic.enable=false", "actor.use_kl_loss=true",
         "algorithm.kl_in_reward=false", "actor.ppo_epochs=1",
         f"actor.mini_batch_size={args.mini_batch}",
         f"actor.micro_batch_tokens={args.micro_tokens}",
         f"trainer.total_steps={args.steps}", "trainer.save_every=0",
         "trainer.save_hf_at_end=false", "trainer.loggers=[jsonl]", f"trainer.output_dir={out}",
         f"trainer.offload={str(args.offload).lower()}", f"actor.recompute={args.recompute}"]
    if mode == "lora":
        o += [f"actor.lora.rank={args.rank}", f"actor.lora.alpha={2 * args.rank}",
              "actor.lora.target_modules=all-linear", f"actor.lr={args.lora_lr}"]
    else:
        o += [f"actor.lr={args.full_lr}"]
    return o + list(args.extra)


def summarize(mode: str, args, rows: list[dict], returncode: int, log_text: str,
              wall: float) -> dict:
    """One mode's JSON line from its metrics rows and log."""
    steps = []
    for m in rows:
        phases = {k[len("timing/"):-2]: v for k, v in m.items()
                  if k.startswith("timing/") and k.endswith("_s") and k != "timing/step_s"}
        peaks = [v for k, v in m.items() if k.startswith("memory/") and k.endswith("_peak_gib")
                 and v is not None]
        steps.append({"step_s": m.get("timing/step_s"), "phases_s": phases,
                      "peak_gib": max(peaks) if peaks else None,
                      "response_length_mean": m.get("response_length/mean"),
                      "kl_actor_ref": m.get("kl/actor_ref")})
    trainable = re.search(r"actor: LoRA rank \d+ .*: (\d+) trainable parameters", log_text)
    last = steps[-1] if steps else {}
    fits = returncode == 0 and len(steps) == args.steps
    out = {"bench": "lora_grpo", "mode": mode, "shape": args.shape, "fits": fits,
           "returncode": returncode, "wall_s": round(wall, 1), "steps_logged": len(steps),
           "step_s": last.get("step_s"), "peak_gib": last.get("peak_gib"),
           "phases_s": last.get("phases_s"),
           "trainable_params": int(trainable.group(1)) if trainable else None,
           "lora_rank": args.rank if mode == "lora" else None,
           "samples_per_step": args.prompts * args.n, "prompt_len": args.prompt_len,
           "max_new_tokens": args.max_new, "steps": steps}
    if not fits:
        out["log_tail"] = log_text[-1500:]
    return out


def launch_subprocess(trainer_args: list[str], timeout_s: int) -> tuple[int, str]:
    """``python -m parallel_models.rl.train *trainer_args`` -> (exit code, its output)."""
    cmd = [sys.executable, "-m", "parallel_models.rl.train", *trainer_args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        return proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        return -9, f"over {timeout_s} s\n{err.stderr or ''}"


def run_mode(args, mode: str, model: str, data: str, root: str, launch=launch_subprocess) -> dict:
    out = os.path.join(root, f"run_{mode}")
    trainer_args = overrides(args, mode, model, data, out)
    log(f"{mode}: {' '.join(trainer_args[:6])} ...")
    t0 = time.time()
    returncode, text = launch(trainer_args, args.timeout_s)
    rows = []
    path = os.path.join(out, "metrics.jsonl")
    if os.path.isfile(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return summarize(mode, args, rows, returncode, text, time.time() - t0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--rank", type=int, default=64, help="LoRA rank (alpha = 2 x rank)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-new", type=int, default=512, help="largest response cap")
    p.add_argument("--mini-batch", type=int, default=64)
    p.add_argument("--micro-tokens", type=int, default=8192)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 else")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--offload", action="store_true", help="trainer.offload (CUDA)")
    p.add_argument("--lora-lr", type=float, default=1e-5)
    p.add_argument("--full-lr", type=float, default=1e-6)
    p.add_argument("--timeout-s", type=int, default=1800, help="per mode")
    p.add_argument("--root", default=None, help="work folder (model, data, runs)")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--extra", nargs="*", default=[], help="more trainer overrides, key=value")
    args = p.parse_args(argv)
    if args.dtype is None:
        import torch

        args.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    return args


def main(argv=None, launch=launch_subprocess) -> list[dict]:
    """Every mode of ``argv``'s settings; ``launch(trainer_args, timeout_s) -> (exit code,
    output)`` runs the trainer (default: a subprocess)."""
    import tempfile

    import torch

    args = parse_args(argv)
    root = args.root or tempfile.mkdtemp(prefix="lora_grpo_")
    model = os.path.join(root, f"model_{args.shape}")
    if not os.path.isfile(os.path.join(model, "config.json")):
        log(f"writing the {args.shape} model to {model}")
        build_model(model, SHAPES[args.shape], "cuda" if torch.cuda.is_available() else "cpu")
    data = os.path.join(root, "prompts.jsonl")
    build_data(data, args.prompts * args.steps, args.prompt_len, SHAPES[args.shape]["vocab_size"],
               args.max_new)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    lines = []
    for mode in args.modes:
        line = {**run_mode(args, mode, model, data, root, launch), "device": device}
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")
        lines.append(line)
    return lines


if __name__ == "__main__":
    main()
