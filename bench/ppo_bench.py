"""One PPO run on the GPU, with and without offload: time and peak memory per phase.

    python bench/ppo_bench.py [--steps 3] [--out results.json]

Model: Qwen2-0.5B-shaped (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, tied
embeddings, bf16, random weights) with the built-in character tokenizer as vocabulary, so the
rule reward can read its outputs. Each setting runs in its own process (clean memory counters).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def build_model(folder: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from parallel_models.tokenizer import build_builtin_tokenizer

    tok = build_builtin_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=896, intermediate_size=4864,
                      num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    root = tempfile.mkdtemp()
    folder = os.path.join(root, "qwen2_05b")
    build_model(folder)
    results = {}
    for offload in (False, True):
        out = os.path.join(root, f"run_offload_{offload}")
        cmd = [sys.executable, "-m", "parallel_models.rl.train", f"model.path={folder}",
               "model.dtype=bfloat16", f"trainer.total_steps={args.steps}", f"trainer.output_dir={out}",
               f"trainer.offload={str(offload).lower()}", "trainer.save_every=0",
               "trainer.save_hf_at_end=false", "data.batch_size=32", "rollout.n=4",
               "rollout.max_new_tokens=128", "actor.mini_batch_size=64",
               "actor.micro_batch_tokens=8192", "actor.lr=1e-6", "critic.lr=1e-6"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-4000:])
            raise SystemExit(f"PPO run failed (offload={offload})")
        rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
        last = rows[-1]
        results[f"offload={offload}"] = {k: round(v, 3) for k, v in last.items()
                                         if k.startswith(("timing/", "memory/", "reward/mean"))}
    print(json.dumps(results, indent=1))
    if args.out:
        json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
