"""Weight sync of the hybrid engine on one GPU: in-process reshard into the rollout model and a
streamed push to the rollout server, time and extra memory, for the 0.5B and 8B shapes.

    python bench/weight_sync_bench.py [--shapes 0.5b 8b] [--bucket-mb 512] [--push-bucket-mb 64]
                                      [--skip-push] [--transports stream group]
                                      [--group-transport auto] [--server-gpu N]
                                      [--out results.json]

Random bf16 weights of the Qwen2-0.5B shape (hidden 896, 24 layers, 14/2 heads, vocab 151936,
tied) and the Llama-3-8B shape (hidden 4096, 32 layers, 32/8 heads, ffn 14336, vocab 128256).

- ``inprocess``: actor TP=1 -> rollout TP'=1 copy (``HybridRollout(share_weights=False)``: with
  equal layouts the trainer itself shares the actor's weights and copies nothing; this times the
  path PP > 1 or TP' != TP takes). ``first_extra_gib``: peak GPU memory above the start during
  the first sync (its kept bucket buffer + temporaries); ``later_extra_gib``: during a later
  sync. The rollout model itself (one more copy of the weights) is ``rollout_model_gib``.
- ``push``: the actor saved once as an HF folder, a server started on it (same GPU, or GPU
  ``--server-gpu N``: its ``CUDA_VISIBLE_DEVICES``), then for each of ``--transports`` (median
  of 3): ``stream``: the actor streamed to ``POST /update_weights_stream``; ``group``: broadcast
  over a process group with the server (``weight_push: group``; ``--group-transport auto`` picks
  CUDA IPC when the server is on the trainer's GPU, NCCL when it is on another). The first group
  push includes joining the group (``first_seconds``). ``trainer_extra_gib``: peak GPU memory
  above the start on the trainer side. The stream push stages the pushed weights in host memory
  (one model's bytes) and its atomic swap keeps a host snapshot too; the group push stages them
  on the server's GPU (one model's bytes, freed to its caching allocator after the swap) and
  needs no snapshot. ``server_split``: the server's own receive / swap seconds of the last push.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import gpu_state, timed  # noqa: E402  (bench/common.py: the one timing method)

GIB = 2**30
SHAPES = {
    "0.5b": ("Qwen2Config", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                 num_attention_heads=14, num_key_value_heads=2,
                                 vocab_size=151936, tie_word_embeddings=True,
                                 architectures=["Qwen2ForCausalLM"])),
    "8b": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                               tie_word_embeddings=False, rope_theta=500000.0,
                               architectures=["LlamaForCausalLM"])),
}


def build_actor(shape: str):
    import transformers

    import parallel_models as pm

    cls_name, kw = SHAPES[shape]
    hf = getattr(transformers, cls_name)(max_position_embeddings=4096, torch_dtype="bfloat16",
                                         **kw)
    config = pm.ModelConfig.from_hf(hf)
    cls = pm.get_model_class(kw["architectures"][0], "causal_lm", rmpad=True)
    model = cls(config, dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    return model


def model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def bench_inprocess(actor, bucket_bytes: int) -> dict:
    from parallel_models.rl.rollout.hybrid import HybridRollout

    hybrid = HybridRollout(actor, 1, share_weights=False, bucket_bytes=bucket_bytes)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    first = hybrid.sync(version=0)
    first_extra = torch.cuda.max_memory_allocated() - base
    version = iter(range(1, 1000))
    seconds = timed(lambda: hybrid.sync(version=next(version)), warmup=1, iters=5)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    hybrid.sync(version=-1)
    later_extra = torch.cuda.max_memory_allocated() - base
    equal = all(torch.equal(a, b) for a, b in zip(actor.parameters(),
                                                  hybrid.engine.model.parameters()))
    out = {"seconds": round(seconds, 4), "first_sync_seconds": round(first, 4),
           "first_extra_gib": round(first_extra / GIB, 3),
           "later_extra_gib": round(later_extra / GIB, 3),
           "kept_buffers_gib": round(hybrid.weight_sync.buffer_bytes / GIB, 3),
           "rollout_model_gib": round(model_bytes(hybrid.engine.model) / GIB, 3),
           "buckets": len(hybrid.weight_sync.buckets), "bit_identical": equal}
    del hybrid
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _push_rounds(push, client, transport: str) -> dict:
    """Three pushes with ``push()`` (median), the trainer's extra GPU memory, the server's split."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times, versions = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        versions.append(push())
        times.append(time.perf_counter() - t0)
    extra = torch.cuda.max_memory_allocated() - base
    split = (client.info().get("last_weight_push") if transport == "stream" else
             client.weights_group("status"))
    return {"seconds": round(sorted(times)[1], 3), "first_seconds": round(times[0], 3),
            "rounds": [round(t, 3) for t in times], "versions": versions,
            "trainer_extra_gib": round(extra / GIB, 3), "server_split": split}


def bench_push(actor, bucket_bytes: int, workdir: str, transports=("stream",),
               group_transport: str = "auto", server_gpu: int | None = None,
               group_bucket_bytes: int | None = None) -> dict:
    from parallel_models.distributed import free_port
    from parallel_models.inference.server.client import RolloutClient
    from parallel_models.inference.server.launch import start_server, stop_server
    from parallel_models.inference.server.weight_group_push import push_weight_group
    from parallel_models.inference.server.weight_stream import push_weight_stream

    folder = os.path.join(workdir, "actor")
    t0 = time.perf_counter()
    actor.save_pretrained(folder, overwrite=True)
    save_s = time.perf_counter() - t0
    port = free_port()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if server_gpu is not None:  # the trainer's CUDA is initialized: only the server sees this
        os.environ["CUDA_VISIBLE_DEVICES"] = str(server_gpu)
    try:
        proc = start_server(folder, port, log_path=os.path.join(workdir, "server.log"),
                            extra=("--dtype", "bfloat16"), timeout=900)
    finally:
        if server_gpu is not None:
            if visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
    client = RolloutClient(f"http://127.0.0.1:{port}", timeout=900)
    out = {"folder_save_s": round(save_s, 2), "server_gpu": server_gpu}
    try:
        for transport in transports:
            if transport == "stream":
                def push():
                    return push_weight_stream(actor, client, bucket_bytes=bucket_bytes)
            else:
                def push():
                    return push_weight_group(actor, client, bucket_bytes=group_bucket_bytes,
                                             transport=group_transport)
            out[transport] = _push_rounds(push, client, transport)
            if transport == "group":
                split = out[transport]["server_split"]
                out[transport]["transport"] = split["transport"]
                out[transport]["server_split"] = split["last_push"]
            print(transport, json.dumps(out[transport]), flush=True)
        t0 = time.perf_counter()
        client.update_weights(folder)  # the folder path, for comparison (already saved)
        out["folder_load_s"] = round(time.perf_counter() - t0, 2)
    finally:
        client.close()
        stop_server(proc)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["0.5b", "8b"], choices=sorted(SHAPES))
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--push-bucket-mb", type=int, default=64,
                    help="bucket size of the streamed push (weight_stream.STREAM_BUCKET_BYTES)")
    ap.add_argument("--skip-push", action="store_true")
    ap.add_argument("--transports", nargs="+", default=["stream", "group"],
                    choices=["stream", "group"], help="server push paths to time")
    ap.add_argument("--group-transport", default="auto", choices=["auto", "gloo", "nccl", "ipc"],
                    help="group push: auto = CUDA IPC on the trainer's GPU, NCCL on another")
    ap.add_argument("--group-bucket-mb", type=int, default=None,
                    help="group push bucket size (default: weight_group_push.GROUP_BUCKET_BYTES)")
    ap.add_argument("--server-gpu", type=int, default=None,
                    help="run the server on this GPU (default: the trainer's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("weight_sync_bench needs a GPU")
    import parallel_models as pm

    pm.init_parallel(tensor_parallel_size=1)
    results = {"device": torch.cuda.get_device_name(), "gpu": gpu_state(),
               "bucket_mb": args.bucket_mb, "date": time.strftime("%Y-%m-%d")}
    for shape in args.shapes:
        actor = build_actor(shape)
        row = {"model_gib": round(model_bytes(actor) / GIB, 3)}
        row["inprocess"] = bench_inprocess(actor, args.bucket_mb << 20)
        print(shape, "inprocess", json.dumps(row["inprocess"]), flush=True)
        if not args.skip_push:
            with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
                row["push"] = bench_push(
                    actor, args.push_bucket_mb << 20, tmp, args.transports, args.group_transport,
                    args.server_gpu, args.group_bucket_mb << 20 if args.group_bucket_mb else None)
            print(shape, "push", json.dumps(row["push"]), flush=True)
        results[shape] = row
        del actor
        gc.collect()
        torch.cuda.empty_cache()
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
