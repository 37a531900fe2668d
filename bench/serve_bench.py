"""Rollout-server throughput: requests/s and generated tokens/s at several client concurrencies.

    python bench/serve_bench.py [--model PATH] [--tp 1] [--concurrency 1 4 16 64]
                                [--requests 64] [--prompt-len 32] [--max-new-tokens 32]
                                [--size tiny|small] [--server-arg=--static-batching]
                                [--out results.json]

Starts ``python -m parallel_models.inference.server`` (torchrun for --tp > 1) on a free
localhost port, warms it up, then for each concurrency C sends ``--requests`` single-prompt
requests from C client threads (httpx, one shared pool), greedy with ``ignore_eos`` so every
request generates exactly ``--max-new-tokens`` tokens. Without --model a random model is built
with the built-in character tokenizer as vocabulary: ``tiny`` (hidden 64, 2 layers; CPU) or
``small`` (Qwen2-0.5B-shaped, bf16; GPU).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import tempfile
import time

from parallel_models.distributed import free_port
from parallel_models.inference.server.launch import start_server, stop_server


def build_model(folder: str, size: str) -> None:
    import torch

    from parallel_models.tokenizer import build_builtin_tokenizer

    tok = build_builtin_tokenizer()
    if size == "tiny":
        from parallel_models.testing import save_tiny_hf_model

        save_tiny_hf_model(folder, "llama", seed=0, vocab_size=len(tok))
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = Qwen2Config(vocab_size=len(tok), hidden_size=896, intermediate_size=4864,
                          num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                          max_position_embeddings=4096, tie_word_embeddings=True,
                          architectures=["Qwen2ForCausalLM"])
        torch.manual_seed(0)
        Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)


def run_level(client, prompts, concurrency: int, max_new: int) -> dict:
    from parallel_models.inference.sampling import SamplingParams

    # the /generate body: the sampling params (greedy, every request runs to max_new) + prompts
    params = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=max_new).model_dump()

    def one(p):
        t = time.perf_counter()
        r = client.post("/generate", json={"prompts": [p], **params, "return_text": False})
        r.raise_for_status()
        return len(r.json()["results"][0]["samples"][0]["token_ids"]), time.perf_counter() - t

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    lat = sorted(o[1] for o in outs)
    return {"concurrency": concurrency, "requests": len(prompts), "seconds": round(wall, 3),
            "requests_per_s": round(len(prompts) / wall, 2),
            "tokens_per_s": round(sum(o[0] for o in outs) / wall, 1),
            "latency_p50_s": round(lat[len(lat) // 2], 3),
            "latency_p95_s": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--size", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="one more server option, e.g. --server-arg=--static-batching")
    ap.add_argument("--out")
    args = ap.parse_args()
    import httpx

    tmp = tempfile.mkdtemp(prefix="serve_bench_")
    model = args.model
    if model is None:
        model = os.path.join(tmp, f"model_{args.size}")
        build_model(model, args.size)
    port = free_port()
    proc = start_server(model, port, tp=args.tp, log_path=os.path.join(tmp, "server.log"),
                        extra=("--max-batch", "64", "--max-new-tokens",
                               str(max(args.max_new_tokens, 32)), *args.server_arg),
                        timeout=600)
    rows = []
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600,
                              limits=httpx.Limits(max_connections=256))
        info = client.get("/info").json()
        vocab = info["vocab_size"]
        rng = random.Random(0)
        prompts = [[1] + [rng.randrange(4, vocab) for _ in range(args.prompt_len - 1)]
                   for _ in range(args.requests)]
        run_level(client, prompts[:4], 4, args.max_new_tokens)  # warm-up
        for c in args.concurrency:
            row = run_level(client, prompts, c, args.max_new_tokens)
            rows.append(row)
            print(json.dumps(row), flush=True)
        stats = client.get("/info").json()["stats"]
        client.post("/shutdown")
        proc.wait(60)
    finally:
        stop_server(proc)
    result = {"server_args": args.server_arg, "model": model, "size": args.size if args.model is None else None, "tp": args.tp,
              "dtype": info.get("dtype"), "prompt_len": args.prompt_len,
              "max_new_tokens": args.max_new_tokens, "levels": rows, "server_stats": stats}
    print("\n| concurrency | req/s | tokens/s | p50 s | p95 s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['requests_per_s']} | {r['tokens_per_s']} | "
              f"{r['latency_p50_s']} | {r['latency_p95_s']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
