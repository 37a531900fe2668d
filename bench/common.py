"""What the GPU benches share: CUDA-event timing, side-by-side contenders alternated over rounds
(median and spread, with the GPU's clocks and temperature beside them), a kernel profile table,
printing/saving results.

Benches run as scripts (``python bench/x.py``), so their folder is on ``sys.path`` and they
``from common import ...``.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time

import torch


def add_decode_shape_args(p) -> None:
    """The decode workload of the rollout benches: batch sizes, prompt and new tokens."""
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)


LLAMA_089B = dict(hidden=2048, layers=16, heads=16, kv_heads=8, intermediate=5632, vocab=32000)
LLAMA3_8B = dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256)


def add_llama_shape_args(p, seq: bool = True, shape: dict = LLAMA_089B) -> None:
    """The dense model shape every Llama bench takes (default: the 0.89B shape of the issues;
    the scaling benches pass ``LLAMA3_8B``)."""
    for name, default in shape.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    if seq:
        p.add_argument("--seq", type=int, default=4096)


def build_random_llama(args, cls, seed: int, **kwargs):
    """``cls`` (one of our Llama model classes) of ``args``' shape in bf16, rope theta 500000,
    weights drawn on the device (normal 0.02, norms 1) from ``seed``: no checkpoint."""
    from transformers import LlamaConfig

    from parallel_models.config import ModelConfig

    hf_cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=8192, rope_theta=500000.0,
                         architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
    model = cls(ModelConfig.from_hf(hf_cfg), dtype=torch.bfloat16, **kwargs)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            prm.fill_(1.0) if "norm" in name else prm.normal_(0.0, 0.02, generator=gen)
    return model


def timed_steps(step, iters: int, warmup: int = 2, before=None, after=None) -> list[float]:
    """Seconds of each of ``iters`` calls of ``step`` after ``warmup`` ones, every rank starting
    together (a barrier) and timed with CUDA events; ``before`` / ``after`` run around each
    timed call (e.g. to reset and read per-step probes)."""
    import torch.distributed as dist

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
        if after is not None:
            after()
    return times


def add_scaling_args(p) -> None:
    """What tp_bench and pp_bench share: tokens per GPU (per microbatch), timed steps, the
    CUDA_DEVICE_MAX_CONNECTIONS=1 switch, a TP=1 result to compare with, the output file."""
    p.add_argument("--tokens-per-gpu", type=int, default=4096,
                   help="tokens per GPU (pp_bench: per microbatch)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--max-connections-1", action="store_true")
    p.add_argument("--tp1-json", default=None)
    p.add_argument("--out", default=None)


def add_moe_shape_args(p) -> None:
    """The Qwen3-MoE shape of the MoE benches (64 experts, top-8, expert size 768)."""
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--expert-size", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=4096)


def save_llama_model(args, max_positions: int = 8192):
    """A random-weight bf16 Llama of ``args``' shape (seed 0) saved as an HF folder; returns
    ``(config, folder)``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=max_positions, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    folder = os.path.join(tempfile.mkdtemp(), "model")
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(folder)
    return cfg, folder


def ragged_batch(tokens: int, max_len: int, vocab: int, device, min_len: int = 256):
    """An RL-like padded batch: lengths uniform in [min_len, max_len] (seed 0) until ``tokens``
    real tokens; returns ``(lengths, ids [N, max(lengths)], mask)`` (right padding)."""
    g = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < tokens:
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        lengths.append(n)
        total += n
    ids = torch.randint(0, vocab, (len(lengths), max(lengths)), device=device)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return lengths, ids, mask


def matmul_peak_tflops(dev) -> float:
    """The measured bf16 matmul peak: TFLOP/s of an 8192^3 product (median, CUDA events)."""
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    return 2 * 8192**3 / timed(lambda: a @ b, warmup=3, iters=20) / 1e12


def timed(fn, warmup: int = 2, iters: int = 5) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs after ``warmup`` runs (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def bandwidth(dev: torch.device) -> float:
    """Nominal HBM bandwidth (bytes/s) of the device, for byte floors (H100 3.35 TB/s, H200
    4.8 TB/s; the CPU's 50 GB/s only makes smoke runs print something)."""
    if dev.type != "cuda":
        return 50e9  # nominal: the smoke run's floors mean nothing
    name = torch.cuda.get_device_name()
    return 4.8e12 if "H200" in name else 3.35e12 if "H100" in name else 2.0e12


def graph_us(calls, dev, reps: int = 20, replays: int = 5) -> float:
    """Microseconds per call of ``calls[i % len(calls)]()`` (i < reps) captured in one CUDA
    graph, median over ``replays`` replays (CPU: wall time of the eager calls)."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for i in range(reps):
            calls[i % len(calls)]()
        return 1e6 * (time.perf_counter() - t0) / reps
    for fn in calls:  # compile / autotune outside the capture
        fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls[0]()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(1e3 * a.elapsed_time(b) / reps)
    del graph
    return sorted(times)[len(times) // 2]


def gpu_state() -> dict:
    """The GPU's SM / memory clocks (MHz), temperature (C) and power (W) now, from nvidia-smi
    (empty where it is missing): a slow round next to a low clock or a hot GPU is the GPU's."""
    fields = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw")
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                               "--format=csv,noheader,nounits", "-i", "0"], capture_output=True,
                              text=True, timeout=10).stdout.strip().splitlines()[0]
        return {k: float(v) for k, v in zip(fields, line.split(", "))}
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        return {}


def alternate(contenders: dict, rounds: int = 3, warmup: int = 2, iters: int = 5) -> dict:
    """Time each ``name -> fn`` side by side, order-robust: ``rounds`` rounds, each timing every
    contender once (median of ``iters`` after ``warmup``), the order rotated every round so no
    contender always runs first (after a cooler GPU) or last. Returns per contender the median over
    rounds, the spread ``(max - min) / median``, the rounds' times, and the GPU state after each
    round."""
    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    states = []
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            times[name].append(timed(contenders[name], warmup=warmup, iters=iters))
        states.append(gpu_state())
    out = {}
    for name, ts in times.items():
        med = sorted(ts)[len(ts) // 2]
        out[name] = {"median_s": med, "spread": (max(ts) - min(ts)) / med, "rounds_s": ts}
    out["gpu_state_per_round"] = states
    return out


def peak_gib(fn) -> float:
    """Peak CUDA memory allocated (GiB) during one call of ``fn``."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def kernel_table(fn, path: str, rows: int = 45) -> None:
    """Profile one call of ``fn`` (after one warm call): ops by CUDA self time, to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows,
                                          max_name_column_width=100))


def report(results: dict, out: str | None) -> None:
    """Print ``results`` as JSON and, with ``out``, write them there."""
    print(json.dumps(results, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
