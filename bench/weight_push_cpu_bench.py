"""Trainer -> rollout-server weight push on the CPU: the streamed push (``POST
/update_weights_stream``) and the group push (gloo broadcast over a process group with the
server, ``weight_push: group``) side by side with the folder path (``save_pretrained`` + ``POST
/update_weights``), with where the time goes.

    python bench/weight_push_cpu_bench.py [--layers 24] [--dtype bfloat16] [--rounds 3]
                                          [--bucket-mb 64] [--tp 1] [--profile]
                                          [--transports stream group]

Random weights of the Qwen2-0.5B shape (hidden 896, 14/2 heads, vocab 151936, tied; ``--layers``
trims it). Prints JSON: the model's bytes, each push's seconds and MB/s, the server's own split
(``receive_seconds``: body read + staged; ``seconds``: the atomic swap), the folder save and load
seconds. ``--profile`` adds the top cProfile entries of one trainer-side push (the server's side
shows in its ``receive_seconds`` / ``seconds``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time

import torch

MB = 1e6


def build_actor(layers: int, dtype: torch.dtype):
    import transformers

    import parallel_models as pm

    hf = transformers.Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                  tie_word_embeddings=True, max_position_embeddings=4096,
                                  architectures=["Qwen2ForCausalLM"])
    config = pm.ModelConfig.from_hf(hf)
    model = pm.get_model_class("Qwen2ForCausalLM", "causal_lm", rmpad=True)(config, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    return model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=None,
                    help="stream bucket size (default: weight_stream.STREAM_BUCKET_BYTES)")
    ap.add_argument("--tp", type=int, default=1, help="the server's TP (torchrun ranks)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--transports", nargs="+", default=["stream", "group"],
                    choices=["stream", "group"], help="push paths to time")
    ap.add_argument("--group-bucket-mb", type=int, default=None,
                    help="group push bucket size (default: weight_group_push.GROUP_BUCKET_BYTES)")
    args = ap.parse_args(argv)

    import parallel_models as pm
    from parallel_models.distributed import free_port
    from parallel_models.inference.server.client import RolloutClient
    from parallel_models.inference.server.launch import start_server, stop_server
    from parallel_models.inference.server.weight_group_push import (GROUP_BUCKET_BYTES,
                                                                     push_weight_group)
    from parallel_models.inference.server.weight_stream import (STREAM_BUCKET_BYTES,
                                                                 push_weight_stream)

    pm.init_parallel(tensor_parallel_size=1)
    bucket = args.bucket_mb << 20 if args.bucket_mb else STREAM_BUCKET_BYTES
    dtype = getattr(torch, args.dtype)
    actor = build_actor(args.layers, dtype)
    nbytes = sum(p.numel() * p.element_size() for p in actor.parameters())
    out: dict = {"model_mb": round(nbytes / MB, 1), "dtype": args.dtype, "server_tp": args.tp,
                 "bucket_mb": bucket >> 20, "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "actor")
        t0 = time.perf_counter()
        actor.save_pretrained(folder, overwrite=True)
        out["folder_save_s"] = round(time.perf_counter() - t0, 3)
        port = free_port()
        proc = start_server(folder, port, tp=args.tp, log_path=os.path.join(tmp, "server.log"),
                            extra=("--dtype", args.dtype), timeout=600)
        client = RolloutClient(f"http://127.0.0.1:{port}", timeout=600)
        try:
            group_bucket = (args.group_bucket_mb << 20 if args.group_bucket_mb
                            else GROUP_BUCKET_BYTES)
            for transport in args.transports:
                pushes = []
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    answer = (push_weight_stream(actor, client, bucket_bytes=bucket)
                              if transport == "stream" else
                              push_weight_group(actor, client, bucket_bytes=group_bucket))
                    s = time.perf_counter() - t0
                    pushes.append({"seconds": round(s, 3), "mb_per_s": round(nbytes / MB / s, 1),
                                   "version": answer})
                out[f"push_{transport}"] = pushes
                out[f"push_{transport}_server_split"] = (
                    client.info().get("last_weight_push") if transport == "stream" else
                    client.weights_group("status").get("last_push"))
                print(transport, json.dumps(pushes), file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            loaded = client.update_weights(folder)
            out["folder_load_s"] = round(time.perf_counter() - t0, 3)
            out["folder_load_server_s"] = loaded.get("seconds")
            out["folder_total_s"] = round(out["folder_save_s"] + out["folder_load_s"], 3)
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                push_weight_stream(actor, client, bucket_bytes=bucket)
                prof.disable()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
                print(text.getvalue(), file=sys.stderr)
        finally:
            client.close()
            stop_server(proc)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
