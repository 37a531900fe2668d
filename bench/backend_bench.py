"""The two training backends on one GPU: PPO steps of the 0.5B shape with parallel.backend=megatron
and =fsdp, time and peak memory per phase (the trainer's own timers and CUDA peak counters).

    python bench/backend_bench.py [--steps 2] [--out results.json] [--no-offload-run] [--skip-megatron]

Same workload and model as bench/ppo_bench.py (Qwen2-0.5B-shaped, random weights, bf16, the
built-in character vocabulary; 32 prompts x 4 samples, up to 128 new tokens, 2 PPO epochs,
minibatch 64). megatron: our parallel models (bf16 params, fp32 master weights in the megatron
optimizer). fsdp: the transformers model under FSDP2 on a one-GPU mesh (fp32 master params,
MixedPrecisionPolicy bf16 compute / fp32 reduce), SDPA packed sequences (flash-attn when
installed), rollout with our CausalLM refilled layer by layer from the FSDP actor. Each run in
its own process; the numbers are the last step's. A third run repeats fsdp with
trainer.offload=true (the FSDP offload between phases).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ppo_bench import build_model  # noqa: E402  (same model as the PPO bench)

COMMON = ["model.dtype=bfloat16", "trainer.save_every=0", "trainer.save_hf_at_end=false",
          "data.batch_size=32", "rollout.n=4", "rollout.max_new_tokens=128",
          "actor.mini_batch_size=64", "actor.micro_batch_tokens=8192", "actor.lr=1e-6",
          "critic.lr=1e-6", "trainer.loggers=[jsonl]"]


def run(folder: str, out: str, steps: int, backend: str, offload: bool) -> dict:
    cmd = [sys.executable, "-m", "parallel_models.rl.train", f"model.path={folder}",
           f"trainer.total_steps={steps}", f"trainer.output_dir={out}",
           f"parallel.backend={backend}", f"trainer.offload={str(offload).lower()}", *COMMON]
    start = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired:
        return {"error": "no result in 150 s"}
    if proc.returncode != 0:
        print(proc.stderr[-4000:])
        return {"error": proc.stderr[-800:]}
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    last = rows[-1]
    result = {k: round(v, 3) for k, v in last.items()
              if k.startswith(("timing/", "memory/", "reward/mean"))}
    result["wall_s_with_startup"] = round(time.time() - start, 1)
    result["reward_by_step"] = [round(r["reward/mean"], 3) for r in rows]
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-offload-run", action="store_true")
    parser.add_argument("--skip-megatron", action="store_true", help="fsdp runs only")
    args = parser.parse_args()
    import torch

    results = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    root = tempfile.mkdtemp()
    folder = os.path.join(root, "qwen2_05b")
    build_model(folder)
    settings = ([] if args.skip_megatron else [("megatron", False)]) + [("fsdp", False)] + (
        [] if args.no_offload_run else [("fsdp", True)])
    for backend, offload in settings:
        name = f"{backend}" + (" offload" if offload else "")
        results[name] = run(folder, os.path.join(root, name.replace(" ", "_")), args.steps,
                            backend, offload)
        print(name, json.dumps(results[name]), flush=True)
        if args.out:  # after every run: a time-out keeps what was measured
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
