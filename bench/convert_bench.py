"""CPU benchmark of the checkpoint converters: GB/s and peak RSS of hf2mcore and mcore2hf on a
generated Llama-style model of a few GB.

    python bench/convert_bench.py --workdir /tmp/convert_bench --size 2GB [--dtype bf16]
        [--threads 1] [--input-cache warm|cold|as-is] [--keep] [--json out.json]

It writes a random HF checkpoint (safetensors shards, written tensor by tensor), then runs each
direction in a fresh process (``conversion.hf2mcore`` / ``conversion.mcore2hf``) and reads that
process's peak resident memory (VmHWM) and its resident memory right before converting (the
imports). Finally it checks the round trip is bit-exact. GB/s = tensor bytes / wall time of the
conversion (from the converter's own summary). fsync is on for every file written. hf2mcore also
reports the time its write-behind thread(s) spent on the records' CRC32s (``crc32_seconds``; it
overlaps the filling of the next buffer).

``--input-cache``: the state of each direction's input files in the page cache when it starts.
``warm`` (default): read through once right before, so the disk only writes (what a conversion
of a just-downloaded or just-written checkpoint sees); ``cold``: dropped from the page cache
(``posix_fadvise(DONTNEED)``), so the disk reads and writes; ``as-is``: whatever is left (the
converters write with O_DIRECT, which leaves nothing cached, and some VMs evict clean pages
within seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import json, os, sys, time
def rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0
from conversion.hf2mcore import convert_hf_to_mcore
from conversion.mcore2hf import convert_mcore_to_hf
import torch
torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
base = rss("VmRSS")
args = json.loads(sys.argv[1])
if args["direction"] == "hf2mcore":
    stats = convert_hf_to_mcore(args["src"], args["out"], progress=False, threads=args["threads"])
else:
    stats = convert_mcore_to_hf(args["src"], args["out"], progress=False)
stats["rss_before"] = base
stats["rss_peak"] = rss("VmHWM")
print("BENCH " + json.dumps(stats))
"""


def model_shape(target_bytes: int, dtype: torch.dtype) -> dict:
    """A Llama-like config (hidden 2048, GQA 16/4 heads, SwiGLU 5632, vocab 32000) with as many
    layers as fit ``target_bytes``."""
    h, ffn, vocab, heads, kv = 2048, 5632, 32000, 16, 4
    d = h // heads
    per_layer = h * h * 2 + 2 * kv * d * h + 3 * h * ffn + 2 * h
    fixed = 2 * vocab * h + h
    size = torch.empty((), dtype=dtype).element_size()
    layers = max(1, round((target_bytes / size - fixed) / per_layer))
    return dict(vocab_size=vocab, hidden_size=h, intermediate_size=ffn, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


def generate(path: str, cfg: dict, dtype: torch.dtype) -> tuple[int, int]:
    """Random HF checkpoint, one tensor in memory at a time. Returns (bytes, largest tensor)."""
    from transformers import LlamaConfig

    from parallel_models.config import ModelConfig
    from parallel_models.llama.checkpoint_utils.hf_format import ShardedSafetensorsWriter
    from parallel_models.llama.checkpoint_utils.weight_map import LLAMA

    os.makedirs(path)
    hf = LlamaConfig(**cfg, dtype={torch.bfloat16: "bfloat16", torch.float32: "float32",
                                   torch.float16: "float16"}[dtype])
    hf.save_pretrained(path)
    config = ModelConfig.from_hf(hf)
    specs = [(n, s, dtype) for m, i in LLAMA.global_jobs(config, "causal_lm")
             for n, s in zip(m.hf_names(i), m.rule.hf_shapes(config))]
    writer = ShardedSafetensorsWriter(path, specs, "1GB")
    gen = torch.Generator().manual_seed(0)
    largest = 0
    for name, shape, _ in specs:
        t = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
        largest = max(largest, t.numel() * t.element_size())
        writer.write(name, t)
    writer.close()
    return writer.total_bytes, largest


def set_cache(folder: str, mode: str) -> None:
    """Put the files of ``folder`` in the page cache (warm) or drop them from it (cold)."""
    if mode == "as-is":
        return
    buf = bytearray(16 << 20)
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            if mode == "cold":
                os.fsync(fd)  # only clean pages can be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while os.readv(fd, [buf]):
                    pass
        finally:
            os.close(fd)


def run_child(direction: str, src: str, out: str, threads: int) -> dict:
    env = dict(os.environ, BENCH_THREADS="1", PYTHONWARNINGS="ignore")
    args = json.dumps({"direction": direction, "src": src, "out": out, "threads": threads})
    proc = subprocess.run([sys.executable, "-c", CHILD, args], capture_output=True, text=True,
                          env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if proc.returncode != 0:
        raise RuntimeError(f"{direction} failed:\n{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")][-1]
    return json.loads(line[len("BENCH "):])


def verify(src: str, back: str) -> None:
    from safetensors import safe_open

    def index(folder):
        with open(os.path.join(folder, "model.safetensors.index.json")) as f:
            return json.load(f)["weight_map"]

    a, b = index(src), index(back)
    assert sorted(a) == sorted(b), "tensor names differ"
    for name in a:
        with safe_open(os.path.join(src, a[name]), "pt") as fa, \
                safe_open(os.path.join(back, b[name]), "pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            assert x.dtype == y.dtype and torch.equal(x, y), f"{name} differs"


def main(argv=None) -> int:
    from parallel_models.llama.checkpoint_utils.hf_format import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/convert_bench")
    p.add_argument("--size", default="2GB", help="model size on disk (default 2GB)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--threads", type=int, default=1, help="hf2mcore writer threads")
    p.add_argument("--input-cache", choices=["warm", "cold", "as-is"], default="warm",
                   help="each direction's input in the page cache (warm, the default), dropped "
                   "from it (cold) or as left")
    p.add_argument("--keep", action="store_true", help="keep the generated folders")
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if os.path.exists(args.workdir):
        shutil.rmtree(args.workdir)
    os.makedirs(args.workdir)
    src, mc, back = (os.path.join(args.workdir, n) for n in ("hf", "mcore", "hf_back"))
    cfg = model_shape(parse_size(args.size), dtype)
    t0 = time.perf_counter()
    total, largest = generate(src, cfg, dtype)
    gen_s = time.perf_counter() - t0
    results = {"device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores",
               "date": time.strftime("%Y-%m-%d"), "model": cfg, "dtype": args.dtype,
               "bytes": total, "largest_tensor": largest, "generate_seconds": round(gen_s, 1),
               "input_cache": args.input_cache, "load_average": os.getloadavg()[0]}
    for direction, a, b in (("hf2mcore", src, mc), ("mcore2hf", mc, back)):
        set_cache(a, args.input_cache)
        st = run_child(direction, a, b, args.threads)
        budget = 2 * largest + 2**30
        results[direction] = {
            "seconds": round(st["seconds"], 2), "GB/s": round(st["bytes"] / st["seconds"] / 1e9, 3),
            "input_read_from_disk_GB": round(st.get("direct_read_bytes", 0) / 1e9, 3),
            "peak_rss_GB": round(st["rss_peak"] / 1e9, 3),
            "rss_before_GB": round(st["rss_before"] / 1e9, 3),
            "peak_minus_before_GB": round((st["rss_peak"] - st["rss_before"]) / 1e9, 3),
            "rss_budget_GB (2 x largest + 1 GiB)": round(budget / 1e9, 3),
            "within_budget": st["rss_peak"] <= budget}
        if "crc_seconds" in st:  # CRC32 of the records, on the write-behind thread(s)
            results[direction]["crc32_seconds"] = round(st["crc_seconds"], 3)
            results[direction]["crc32_GB/s"] = round(
                st["crc_bytes"] / max(st["crc_seconds"], 1e-9) / 1e9, 2)
    verify(src, back)
    results["round_trip_bit_exact"] = True
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if not args.keep:
        shutil.rmtree(args.workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
