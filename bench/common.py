"""What the GPU benches share: CUDA-event timing, side-by-side contenders alternated over rounds
(median and spread, with the GPU's clocks and temperature beside them), a kernel profile table,
printing/saving results.

Benches run as scripts (``python bench/x.py``), so their folder is on ``sys.path`` and they
``from common import ...``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
import threading
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


@functools.cache
def hbm_read_bandwidth(dev, gib: float = 4.0) -> float:
    """Bytes/s that a plain read of ``gib`` GiB of bf16 reaches on this GPU (a float32 sum of it,
    median of 10): the achievable side of the HBM roofline, beside the datasheet figure;
    measured once per device and run."""
    x = torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=dev)
    seconds = timed(lambda: x.sum(dtype=torch.float32), warmup=2, iters=10)
    del x
    return int(gib * 2**30) / seconds


def timed(fn, warmup: int = 2, iters: int = 5, steps: list | None = None) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs after ``warmup`` runs (CUDA events).
    ``steps``: a list that gets ``(host start, host end, seconds)`` of each timed run, to put
    beside :class:`GpuClockLog`'s samples."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.time()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
        if steps is not None:
            steps.append((t0, time.time(), times[-1]))
    return sorted(times)[len(times) // 2]


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


def kernel_seconds(fn, iters: int = 10) -> float:
    """GPU time of the kernels (and copies / memsets) one call of ``fn`` launches, summed from
    the profiler's device events over ``iters`` calls after one warm call: what a GPU-bound step
    pays for ``fn``, free of the host's launch overhead (which :func:`timed` includes where the
    kernels are shorter than their launches)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    # device events: kernels, copies, memsets (not the GPU spans of annotated host ranges,
    # which repeat their kernels' time; the profiler's own "Self CUDA time total" skips them too)
    device_us = sum(e.time_range.elapsed_us() for e in prof.events()
                    if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
    return device_us / 1e6 / iters


class GpuClockLog:
    """The GPU's SM clock (MHz), power (W), temperature (C) and active clock-event reasons
    (nvidia-smi's bitmask: 0x4 software power cap, 0x8 hardware slowdown, 0x20 / 0x40 thermal)
    sampled every ``period_ms`` by ``nvidia-smi -lms`` in its own process while the benchmark
    runs: nothing is added to the timed GPU work, and each timed step can be put beside the
    clocks it ran at (:meth:`during`). Without nvidia-smi it records nothing."""

    FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")

    def __init__(self, period_ms: int = 50):
        self.period_ms = period_ms
        self.samples: list[tuple[float, dict]] = []
        self._proc = None
        self._thread = None

    def __enter__(self):
        if self.period_ms <= 0:
            return self
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={','.join(self.FIELDS)}",
                 "--format=csv,noheader,nounits", "-i", "0", f"-lms={self.period_ms}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return self
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            parts = [v.strip() for v in line.split(",")]
            try:
                row = {k: float(int(v, 16) if v.startswith("0x") else v)
                       for k, v in zip(self.FIELDS, parts)}
            except ValueError:
                continue
            self.samples.append((time.time(), row))

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._thread.join(timeout=10)

    def during(self, t0: float, t1: float) -> dict:
        """Mean clock / power, max temperature and the OR of the clock-event reasons of the
        samples in ``[t0, t1]`` (the nearest sample where none falls inside)."""
        rows = [r for t, r in self.samples if t0 <= t <= t1]
        if not rows and self.samples:
            rows = [min(self.samples, key=lambda s: abs(s[0] - (t0 + t1) / 2))[1]]
        if not rows:
            return {}
        reasons = 0
        for r in rows:
            reasons |= int(r.get("clocks_event_reasons.active", 0))
        return {"sm_mhz": sum(r["clocks.sm"] for r in rows) / len(rows),
                "power_w": sum(r["power.draw"] for r in rows) / len(rows),
                "temp_c": max(r["temperature.gpu"] for r in rows),
                "clock_event_reasons": hex(reasons), "samples": len(rows)}


def _host_counters() -> dict:
    """Counters that a slow round could come from besides the GPU's clock: compiled graphs
    (a recompile), the caching allocator's device allocations / frees and retries (a step that
    calls cudaMalloc or flushes the cache)."""
    stats = torch.cuda.memory_stats()
    out = {k: stats.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
    try:
        from torch._dynamo.utils import counters
        out["compiled_graphs"] = counters["stats"]["unique_graphs"]
    except ImportError:
        out["compiled_graphs"] = 0
    return out


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


def alternate(contenders: dict, rounds: int = 3, warmup: int = 2, iters: int = 5,
              clock_log_ms: int = 50) -> dict:
    """Time each ``name -> fn`` side by side, order-robust: ``rounds`` rounds, each timing every
    contender once (median of ``iters`` after ``warmup``), the order rotated every round so no
    contender always runs first (after a cooler GPU) or last. Returns per contender the median over
    rounds, the spread ``(max - min) / median``, the rounds' times, and per round what could make
    it slow: each timed step's time beside the SM clock / power / temperature / clock-event
    reasons it ran at (:class:`GpuClockLog`), recompiles and allocator activity during the
    round (:func:`_host_counters`); ``clock_normalized_spread`` is the spread of the rounds'
    times scaled to the highest clock seen (time x clock): small where the clock explains the
    spread. Also the GPU state after each round. ``clock_log_ms=0``: no sampling (nvidia-smi
    takes driver calls while it samples, which may itself disturb the steps it watches)."""
    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    detail: dict[str, list[dict]] = {n: [] for n in names}
    states = []
    with GpuClockLog(clock_log_ms) as clocks:
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                before, steps = _host_counters(), []
                times[name].append(timed(contenders[name], warmup=warmup, iters=iters,
                                         steps=steps))
                after = _host_counters()
                per_step = [{"s": s, **clocks.during(t0, t1)} for t0, t1, s in steps]
                detail[name].append({
                    "steps": per_step, **{f"{k}_delta": after[k] - before[k] for k in after},
                    "sm_mhz": _mean([x["sm_mhz"] for x in per_step if "sm_mhz" in x])})
            states.append(gpu_state())
    top_clock = max((d["sm_mhz"] for ds in detail.values() for d in ds if d["sm_mhz"]),
                    default=None)
    out = {}
    for name, ts in times.items():
        med = sorted(ts)[len(ts) // 2]
        out[name] = {"median_s": med, "spread": (max(ts) - min(ts)) / med, "rounds_s": ts,
                     "rounds": detail[name]}
        if top_clock and all(d["sm_mhz"] for d in detail[name]):
            norm = [t * d["sm_mhz"] / top_clock for t, d in zip(ts, detail[name])]
            out[name]["clock_normalized_spread"] = ((max(norm) - min(norm))
                                                  / sorted(norm)[len(norm) // 2])
    out["gpu_state_per_round"] = states
    return out


def _mean(xs: list) -> float | None:
    return sum(xs) / len(xs) if xs else None


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


def gap_table(fn, path: str, rows: int = 25, min_us: float = 5.0) -> dict:
    """Where the GPU idles during one call of ``fn`` (after one warm call): from a chrome trace
    with Python stacks, every gap of at least ``min_us`` between the end of all kernels so far
    and the next kernel's start, charged to what the launching thread was running when the gap
    began (its innermost Python frame of our code, megatron or torch, and its innermost op).
    Writes a table to ``path``; returns the totals (step span, kernel busy time, gap time)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, with_stack=True) as prof:
        fn()
        sync()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            trace = json.load(g)["traceEvents"]
    return _gaps_from_trace(trace, path, rows, min_us)


def _gaps_from_trace(trace: list, path: str, rows: int, min_us: float) -> dict:
    """:func:`gap_table`'s analysis of chrome-trace events."""
    import bisect
    import collections

    spans = [e for e in trace if e.get("ph") == "X" and "dur" in e]
    kernels = sorted((e for e in spans if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                     key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in spans if e.get("cat") == "cuda_runtime"}
    host = collections.defaultdict(list)  # tid -> [(ts, end, kind, name)] of ops and frames
    for e in spans:
        if e.get("cat") in ("cpu_op", "python_function"):
            host[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["cat"], e["name"]))
    for evs in host.values():
        evs.sort()
    starts = {tid: [ev[0] for ev in evs] for tid, evs in host.items()}

    def running(tid, t):
        """(innermost frame of ours / megatron / torch, innermost op) on ``tid`` at ``t``."""
        evs = host.get(tid, [])
        frame = op = None
        i = bisect.bisect_right(starts.get(tid, []), t)  # the last 400 started by t
        for ts, end, kind, name in evs[max(0, i - 400):i]:
            if end < t:
                continue
            if kind == "cpu_op":
                op = name
            elif any(k in name for k in ("parallel_models", "megatron", "bench/", "torch/")):
                frame = name
        return frame, op

    busy_end, gaps, busy = None, collections.Counter(), 0.0
    counts = collections.Counter()
    for k in kernels:
        end = k["ts"] + k["dur"]
        if busy_end is not None and k["ts"] - busy_end >= min_us:
            launch = launches.get(k["args"].get("correlation"))
            tid = launch["tid"] if launch else None
            frame, op = running(tid, busy_end) if tid is not None else (None, None)
            key = f"{frame or '?'} | {op or '?'}"
            gaps[key] += k["ts"] - busy_end
            counts[key] += 1
        busy += max(0.0, end - max(k["ts"], busy_end or k["ts"]))
        busy_end = end if busy_end is None else max(busy_end, end)
    span = busy_end - kernels[0]["ts"] if kernels else 0.0
    total_gap = sum(gaps.values())
    with open(path, "w") as out:
        out.write(f"kernels span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, gaps >= "
                  f"{min_us} us {total_gap / 1e3:.2f} ms in {sum(counts.values())}\n")
        out.write("gap ms | gaps | launching thread at the gap's start: frame | op\n")
        for key, t in gaps.most_common(rows):
            out.write(f"{t / 1e3:8.3f} | {counts[key]:5d} | {key}\n")
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "gap_ms": total_gap / 1e3}


def save(results, out: str | None) -> None:
    """With ``out``, write ``results`` there as JSON."""
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


def report(results: dict, out: str | None) -> None:
    """Print ``results`` as JSON and, with ``out``, write them there."""
    print(json.dumps(results, indent=1))
    save(results, out)


class HostMemoryWatch:
    """Samples, every ``interval`` seconds in a thread, the resident memory of a process and its
    descendants and the machine's available memory; ``result()`` gives their peak / minimum in
    GiB. It outlives the process it watches, so a run the host's out-of-memory killer stops
    still reports how close it came (``with HostMemoryWatch(pid) as watch: ...``)."""

    def __init__(self, pid: int, interval: float = 1.0):
        self.pid, self.interval = pid, interval
        self.rss_peak = 0
        self.available_min = None
        self.total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        rss = 0
        for proc in procs:
            try:
                rss += proc.memory_info().rss
            except psutil.Error:
                pass
        mem = psutil.virtual_memory()
        self.total = mem.total
        self.rss_peak = max(self.rss_peak, rss)
        self.available_min = mem.available if self.available_min is None else \
            min(self.available_min, mem.available)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> "HostMemoryWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def result(self) -> dict:
        gib = 2 ** 30
        return {"host_rss_peak_gib": round(self.rss_peak / gib, 2),
                "host_available_min_gib": None if self.available_min is None
                else round(self.available_min / gib, 2),
                "host_total_gib": round(self.total / gib, 2)}
