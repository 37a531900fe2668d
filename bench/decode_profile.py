"""Where a decode step of the continuous engine spends its time, category by category, beside
each category's HBM byte floor.

    python bench/decode_profile.py [--batches 64 256] [--prompt 128] [--new 256]
                                   [--variants ours baseline ...] [--steps 20] [--out p.json]
    python bench/decode_profile.py --device cpu --hidden 64 --layers 2 --heads 4 --kv-heads 2 \\
        --intermediate 128 --vocab 512 --batches 4 --prompt 8 --new 16     # smoke run

Model: the 0.89B Llama shape of bench/rollout_bench.py (random weights, bf16; fp32 on the CPU);
``--fp8 block|channel``: the decoder linears in FP8 (``inference/fp8.Fp8Linears``, decode
products on ``--fp8-kernel``), their GEMM floors at one byte a weight.
Per batch size B and engine variant (``--variants``; ``ours`` = split-KV triton attention
(``inference/split_kv_attention.py``) + fused draw + pipelined decode, ``aten_attention`` = the
same with PyTorch's flash kernel and two ``index_copy_`` KV writes, ``no_pipeline``,
``no_fused_draw``, ``no_fused_norm`` (each layer's residual sum not fused into the next norm),
``no_fused_rope`` (RoPE by its own kernels, not inside the split-KV attention),
``baseline`` = none of these, profiled too), B prompts of ``prompt + new/2`` tokens
(every row at the bench's mean context) in a ``ContinuousEngine`` whose rows hold
``prompt + new`` positions (the bench's bucket):

- ``engine_step_ms``: wall time of ``engine.step()`` (graph replay + sampling + the host's
  bookkeeping and its one sync): what bench/rollout_bench.py reports as continuous ms/step
  (mean; ``engine_step_median_ms``: the median call);
- ``graph_replay_ms``: the bucket's CUDA graph alone (model + LM head), CUDA events;
- ``draw_ms``: the sampling of the step's logits alone (greedy here);
- (``ours``, ``aten_attention``, ``baseline``) a torch.profiler trace of the same step run EAGERLY (the kernels are those the graph replays;
  eager launches are slower, kernel durations are not), every kernel put in a category by the
  module/function that launched it (labels set by hooks on the model, no model change): qkv /
  o / gate-up / down / LM-head GEMMs, attention, KV write, rope, norms, activation, embedding,
  sampling, other (named by kernel). Beside each: its byte floor at the HBM bandwidth (weights
  for GEMMs, KV bytes for attention, activations for the elementwise ones).
  ``graph_replay_ms - forward kernel sum`` = the gaps between kernels inside the graph;
  ``engine_step_ms - graph_replay_ms - draw_ms`` = the host's share of a step.
- ``attention_micro``: one layer's decode attention at these shapes: the split-KV kernel vs
  PyTorch's flash kernel (+ its two KV writes), microseconds per call captured in a CUDA graph
  (``common.graph_us``: as the engine runs it; ``split_kv_eager_us``: one eager
  call, launch and host included), beside the KV-bytes floor. The launch-config sweep:
  bench/decode_attention_sweep.py.

A markdown table per case is printed; ``--out`` writes everything as JSON. Each case is guarded:
a failure is recorded and the next case runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (add_decode_shape_args, add_llama_shape_args,  # noqa: E402
                    hbm_read_bandwidth, report, save_llama_model, timed)
from common import graph_us  # noqa: E402

LABEL = "dp::"
GEMMS = {"qkv_proj": "qkv_gemm", "o_proj": "o_gemm", "gate_up_proj": "gate_up_gemm",
         "down_proj": "down_gemm"}
# name -> (decode attention kernel, fused draw, pipelined decode, residual sum fused into the
# next norm, profiled by category)
VARIANTS = {
    "ours": ("triton", True, True, True, True),
    "aten_attention": ("aten", True, True, True, True),
    "no_pipeline": ("triton", True, False, True, False),
    "no_fused_draw": ("triton", False, True, True, False),
    "no_fused_norm": ("triton", True, True, False, False),
    "no_fused_rope": ("triton", True, True, True, False),  # rotary kernels, not in the attention
    "baseline": ("aten", False, False, False, True),  # main before issue 17 item 4's changes
}
ORDER = ["qkv_gemm", "o_gemm", "gate_up_gemm", "down_gemm", "lm_head_gemm", "attention",
         "kv_write", "rope", "norm", "activation", "embedding", "sampling", "residual_add",
         "other", "unlinked"]


def bandwidth(dev: torch.device) -> float:
    if dev.type != "cuda":
        return 50e9  # a nominal CPU figure: the smoke run's floors mean nothing
    name = torch.cuda.get_device_name()
    return 4.8e12 if "H200" in name else 3.35e12 if "H100" in name else 2.0e12


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def wall_ms(fn, dev, iters: int, median: list | None = None) -> float:
    """Mean wall milliseconds of ``fn()`` over ``iters`` calls (one warm call first), the device
    synchronized at both ends; with ``median`` (a list) also appends the median call's time
    (robust to a busy host)."""
    fn()
    sync(dev)
    t = time.perf_counter()
    calls = []
    for _ in range(iters):
        c = time.perf_counter()
        fn()
        calls.append(time.perf_counter() - c)
    sync(dev)
    if median is not None:
        median.append(1e3 * sorted(calls)[len(calls) // 2])
    return 1e3 * (time.perf_counter() - t) / iters


def gpu_ms(fn, dev, iters: int) -> float:
    """Median CUDA-event milliseconds of ``fn()`` (``common.timed``; wall time on the CPU)."""
    if dev.type != "cuda":
        return wall_ms(fn, dev, iters)
    return 1e3 * timed(fn, warmup=1, iters=iters)


# ---- labels: every kernel gets the category of the innermost labelled range launching it ----
def _labelled(name, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch.profiler.record_function(LABEL + name):
            return fn(*args, **kwargs)
    return call


@contextlib.contextmanager
def labels(model, cache):
    """Hooks and wrappers naming the decode step's parts (undone on exit)."""
    from parallel_models.llama import modeling
    from parallel_models.llama.layers import attention, decoder_layer, fused_ops
    from parallel_models.inference import pool_cache

    handles, patched = [], []

    def label_module(module, name):
        def pre(mod, args, kwargs=None):
            mod._dp_range = torch.profiler.record_function(LABEL + name)
            mod._dp_range.__enter__()

        def post(mod, args, out):
            mod._dp_range.__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))

    def patch(obj, attr, name):
        own = attr in vars(obj)  # (else a class's method: deleting the wrapper restores it)
        patched.append((obj, attr, getattr(obj, attr) if own else None))
        setattr(obj, attr, _labelled(name, getattr(obj, attr)))

    inner = model.model
    label_module(inner.embed_tokens, "embedding")
    label_module(inner.rotary_emb, "rope")
    label_module(inner.norm, "norm")
    label_module(model.lm_head, "lm_head_gemm")
    for layer in inner.layers:
        label_module(layer.input_layernorm, "norm")
        for attr, cat in GEMMS.items():
            owner = layer.self_attn if attr in ("qkv_proj", "o_proj") else layer.mlp
            if getattr(owner, attr, None) is not None:  # (an MoE layer has no gate_up_proj)
                label_module(getattr(owner, attr), cat)
    patch(attention, "rotary", "rope")
    patch(decoder_layer, "add_rms_norm", "norm")
    patch(modeling, "add_rms_norm", "norm")  # the residual sum fused into the next norm
    patch(fused_ops, "gated_activation", "activation")  # (the MLP's, via gated_mlp_input)
    if fused_ops._output_quantizer is not None:  # (FP8 decode: gate_up + SwiGLU in one kernel)
        patch(fused_ops._output_quantizer, "gated_mlp_input", "gate_up_gemm")
    patch(pool_cache, "split_kv_decode", "attention")  # the triton kernel writes the KV too
    patch(cache, "write_kv", "kv_write")
    patch(cache, "decode_attention", "attention")
    patch(cache, "begin_decode", "other")
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for obj, attr, old in reversed(patched):
            if old is None:
                delattr(obj, attr)  # back to the class's method
            else:
                setattr(obj, attr, old)


def _category(evt) -> str | None:
    e = evt
    while e is not None:
        if e.name.startswith(LABEL):
            return e.name[len(LABEL):]
        e = e.cpu_parent
    return None


def _unlabelled_category(kernel_name: str) -> str:
    n = kernel_name.lower()
    if "add" in n and "index" not in n:
        return "residual_add"  # the layer's x + mlp(x) is the one unlabelled elementwise add
    return "other"


def profile_step(step_fn, dev, iters: int = 3) -> dict:
    """Kernel microseconds per category, averaged over ``iters`` eager calls of ``step_fn``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    step_fn()
    sync(dev)
    with profile(activities=acts) as prof:
        for _ in range(iters):
            step_fn()
        sync(dev)
    us = collections.Counter()
    count = collections.Counter()
    unlabelled = collections.Counter()
    linked = collections.Counter()  # kernel name -> us claimed by a CPU op
    for evt in prof.events():
        if dev.type == "cuda":
            if not evt.kernels:
                continue
            cat = _category(evt)
            for k in evt.kernels:
                c = cat or _unlabelled_category(k.name)
                us[c] += k.duration / iters
                count[c] += 1 / iters
                linked[k.name] += k.duration / iters
                if cat is None:
                    unlabelled[k.name[:80]] += k.duration / iters
        elif not evt.cpu_children and not evt.name.startswith(LABEL):  # CPU: leaf ops' time
            cat = _category(evt) or _unlabelled_category(evt.name)
            us[cat] += evt.self_cpu_time_total / iters
            count[cat] += 1 / iters
            if _category(evt) is None:
                unlabelled[evt.name[:80]] += evt.self_cpu_time_total / iters
    if dev.type == "cuda":  # kernels no CPU op claimed (a launch the profiler did not link,
        # e.g. Triton's driver-API launches): the split-KV kernels by name, the rest "unlinked"
        from torch.autograd import DeviceType

        device_us, device_n = collections.Counter(), collections.Counter()
        for e in prof.events():
            if e.device_type == DeviceType.CUDA and not e.is_user_annotation \
                    and not e.name.startswith(LABEL) and "annotation" not in e.name:
                device_us[e.name] += (e.time_range.end - e.time_range.start) / iters
                device_n[e.name] += 1 / iters
        for name, t in device_us.items():
            lost = t - linked.get(name, 0.0)
            if lost > 0.005 * t and lost > 0.1:
                cat = "attention" if name.startswith(("split_kernel", "combine_kernel")) \
                    else "unlinked"
                us[cat] += lost
                count[cat] += device_n[name] * lost / t
    return {"us": dict(us), "kernels": {k: round(v, 1) for k, v in count.items()},
            "unlabelled_top": dict(unlabelled.most_common(12))}


def byte_floors(cfg, batch: int, context_used: int, dtype_bytes: int,
                linear_bytes: int | None = None) -> dict:
    """Bytes each category must move at least in one decode step of ``batch`` rows whose
    attention spans ``context_used`` positions each (including the new one); the decoder
    linears' weights at ``linear_bytes`` a value (default ``dtype_bytes``; 1: FP8)."""
    h, L, ffn, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    d = h // cfg.num_attention_heads
    qd, kvd = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    act = batch * dtype_bytes
    wb = linear_bytes or dtype_bytes
    return {
        "qkv_gemm": L * (h * (qd + 2 * kvd) * wb + act * (h + qd + 2 * kvd)),
        "o_gemm": L * (qd * h * wb + act * (qd + h)),
        "gate_up_gemm": L * (h * 2 * ffn * wb + act * (h + 2 * ffn)),
        "down_gemm": L * (ffn * h * wb + act * (ffn + h)),
        "lm_head_gemm": vocab * h * dtype_bytes + act * h + batch * vocab * dtype_bytes,
        "attention": L * (2 * kvd * dtype_bytes * batch * context_used + act * 2 * qd),
        "kv_write": L * 2 * 2 * act * kvd,
        "rope": L * 2 * act * (qd + kvd),
        "norm": (2 * L + 1) * 2 * act * h,
        "activation": L * act * 3 * ffn,
        "embedding": 2 * act * h,
        "sampling": batch * vocab * dtype_bytes,
        "residual_add": L * 3 * act * h,
    }


def attention_micro(cfg, batch, context, max_row_tokens, dev, dtype) -> dict:
    """One layer's decode attention: split-KV kernel vs PyTorch's flash (+ KV writes)."""
    from parallel_models.inference import split_kv_attention

    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // h
    g = torch.Generator(device=dev).manual_seed(0)
    end = batch * max_row_tokens + batch
    k_pool = torch.randn(end, kv, d, device=dev, dtype=dtype, generator=g)
    v_pool = torch.randn(end, kv, d, device=dev, dtype=dtype, generator=g)
    q = torch.randn(batch, h, d, device=dev, dtype=dtype, generator=g)
    k_new = torch.randn(batch, kv, d, device=dev, dtype=dtype, generator=g)
    v_new = torch.randn(batch, kv, d, device=dev, dtype=dtype, generator=g)
    offsets = torch.arange(batch, device=dev) * max_row_tokens
    used = torch.full((batch,), context, device=dev, dtype=torch.int32)
    write = offsets + context - 1
    cu_q = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    cu_k = torch.cat([offsets, offsets.new_tensor([end])]).int()
    scale = d ** -0.5
    kv_bytes = 2 * batch * context * kv * d * k_pool.element_size()

    def aten():
        k_pool.index_copy_(0, write, k_new)
        v_pool.index_copy_(0, write, v_new)
        return torch.ops.aten._flash_attention_forward(
            q, k_pool, v_pool, cu_q, cu_k, 1, max_row_tokens, 0.0, False, False, scale=scale,
            seqused_k=used)[0]

    def ours(split=None):
        return split_kv_attention.split_kv_decode(q, k_new, v_new, k_pool, v_pool, offsets,
                                                  used, max_row_tokens, scale, split=split)

    out = {"batch": batch, "context": context, "kv_bytes": kv_bytes,
           "floor_us": 1e6 * kv_bytes / bandwidth(dev),
           "auto_split": split_kv_attention.split_size(batch, kv, max_row_tokens, dev)}
    out["max_abs_diff"] = (aten().float() - ours().float()).abs().max().item()
    for name, fn in (("aten_flash_plus_kv_write", aten), ("split_kv_triton", ours)):
        out[f"{name}_us"] = graph_us([fn], dev)
    out["split_kv_eager_us"] = 1e3 * gpu_ms(ours, dev, 50)
    for split in (64, 128, 256, 512):  # what the automatic split size leaves on the table
        out[f"split_{split}_us"] = graph_us([functools.partial(ours, split)], dev)
    out["split_kv_over_floor"] = out["split_kv_triton_us"] / out["floor_us"]
    out["aten_over_floor"] = out["aten_flash_plus_kv_write_us"] / out["floor_us"]
    return out


def variant_options(variant: str):
    """The kernel options of ``variant`` (parallel_models.options), for the ``with`` around its
    case: the fused draw (read at each draw), the fused residual norm (each forward) and the
    in-kernel RoPE (each step)."""
    from parallel_models.options import options_override

    _, fused, _, fuse_norm, _ = VARIANTS[variant]
    return options_override(fused_draw=fused, decode_fuse_norm=fuse_norm,
                            decode_fuse_rope=variant != "no_fused_rope")


def run_case(args, cfg, model, dev, batch: int, variant: str) -> dict:
    from parallel_models.inference.continuous import ContinuousEngine
    from parallel_models.inference.row_sampling import draw
    from parallel_models.inference.sampling import SamplingParams

    kernel, fused, pipeline, fuse_norm, profiled = VARIANTS[variant]
    half = args.new // 2
    context = args.prompt + half          # prompt length of the profiled rows
    row_tokens = args.prompt + args.new   # the bench's bucket: rows hold prompt + new positions
    eng = ContinuousEngine(model, batch * row_tokens, max_rows=batch, max_row_tokens=row_tokens,
                           pipeline=pipeline)
    if kernel == "triton" and eng.cache.decode_kernel != "triton" and dev.type == "cuda":
        raise RuntimeError("the split-KV triton kernel is unavailable here (see the warning)")
    eng.cache.decode_kernel = kernel if dev.type == "cuda" else "aten"
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=half)
    for p in torch.randint(0, cfg.vocab_size, (batch, context), generator=g).tolist():
        eng.submit(p, params)
    eng.step()  # prefill + first decode step (captures the bucket's graph on CUDA)
    bucket = eng._steps[eng._layout.size]
    steps = min(args.steps, half - 4)
    out = {"batch": batch, "variant": variant, "kernel": eng.cache.decode_kernel,
           "fused_draw": fused, "pipeline": pipeline, "fused_norm": fuse_norm, "context": context,
           "cuda_graph": bucket.graph is not None}
    median: list = []
    out["engine_step_ms"] = wall_ms(eng.step, dev, steps, median)
    out["engine_step_median_ms"] = median[0]
    out["graph_replay_ms"] = gpu_ms(bucket.graph.replay, dev, 20) if bucket.graph else None
    lay = eng._layout
    logits = bucket.logits if bucket.graph is not None else bucket._forward()
    out["draw_ms"] = gpu_ms(lambda: draw(logits, lay.seeds, lay.steps, lay.spec, lay.k_max),
                            dev, 20)

    def eager_step():
        step_logits = bucket._forward()
        with torch.profiler.record_function(LABEL + "sampling"):
            draw(step_logits, lay.seeds, lay.steps, lay.spec, lay.k_max)

    out["eager_step_ms"] = wall_ms(eager_step, dev, 5)
    used = context + 1 + args.steps  # about where the profiled steps are
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    floors = byte_floors(cfg, batch, used, 2 if dev.type == "cuda" else 4,
                         1 if args.fp8 else None)
    if args.fp8:  # the decoder linears read as e4m3 (their bf16 parameters stay, unread)
        from parallel_models.inference.fp8.rollout_linears import quantized_modules

        weights -= sum(m.weight.numel() * (m.weight.element_size() - 1)
                       for _, m in quantized_modules(model))
    bw = bandwidth(dev)
    out["bench_floor_ms"] = 1e3 * (weights + floors["attention"]) / bw  # rollout_bench's formula
    if profiled:
        with labels(model, eng.cache):
            prof = profile_step(eager_step, dev)
        out["categories"] = {c: {"us": prof["us"].get(c, 0.0),
                                 "kernels": prof["kernels"].get(c, 0),
                                 "floor_us": 1e6 * floors.get(c, 0) / bw}
                             for c in ORDER if c in prof["us"] or floors.get(c)}
        out["unlabelled_top_us"] = prof["unlabelled_top"]
        fwd = sum(v["us"] for c, v in out["categories"].items() if c != "sampling")
        out["forward_kernel_sum_ms"] = fwd / 1e3
        out["kernel_sum_ms"] = (fwd + out["categories"].get("sampling", {}).get("us", 0)) / 1e3
        out["floor_ms"] = sum(floors[c] for c in floors if c != "sampling") * 1e3 / bw
        if out["graph_replay_ms"] is not None:
            out["graph_gaps_ms"] = out["graph_replay_ms"] - out["forward_kernel_sum_ms"]
    if out["graph_replay_ms"] is not None:
        out["host_ms"] = out["engine_step_ms"] - out["graph_replay_ms"] - out["draw_ms"]
    out["engine_over_floor"] = out["engine_step_ms"] / out["bench_floor_ms"]
    if dev.type == "cuda":  # the same floor at the read bandwidth this GPU reaches
        out["measured_read_tb_s"] = hbm_read_bandwidth(dev) / 1e12
        out["engine_over_measured_floor"] = (out["engine_over_floor"] * out["measured_read_tb_s"]
                                             * 1e12 / bw)
    del eng, bucket, logits
    return out


def table(case: dict) -> str:
    lines = [f"### batch {case['batch']}, `{case['variant']}` (attention {case['kernel']}, fused "
             f"draw {case['fused_draw']}, pipeline {case['pipeline']}, fused norm "
             f"{case['fused_norm']}), context {case['context']}"
             f" (CUDA graph: {case['cuda_graph']})", ""]
    if "categories" in case:
        lines += _category_rows(case)
    keys = ("engine_step_ms", "engine_step_median_ms", "graph_replay_ms", "forward_kernel_sum_ms", "graph_gaps_ms",
            "draw_ms", "host_ms", "eager_step_ms", "bench_floor_ms", "engine_over_floor",
            "measured_read_tb_s", "engine_over_measured_floor")
    lines.append(" | ".join(f"{k} {case[k]:.3f}" for k in keys if case.get(k) is not None))
    return "\n".join(lines)


def _category_rows(case: dict) -> list:
    lines = ["| category | kernels/step | us | floor us | x floor | % of kernels |",
             "| --- | --- | --- | --- | --- | --- |"]
    total = 1e3 * case["kernel_sum_ms"] or 1.0
    for c, v in case["categories"].items():
        ratio = v["us"] / v["floor_us"] if v["floor_us"] else float("nan")
        lines.append(f"| {c} | {v['kernels']:g} | {v['us']:.1f} | {v['floor_us']:.1f} | "
                     f"{ratio:.2f} | {100 * v['us'] / total:.1f} |")
    lines.append(f"| **kernel sum** | | {total:.1f} | {1e3 * case['floor_ms']:.1f} | "
                 f"{total / (1e3 * case['floor_ms']):.2f} | 100 |")
    lines.append("")
    return lines


def summary(cases: list) -> str:
    lines = ["| batch | variant | engine ms/step (median call) | graph replay ms | draw ms | host "
             "ms | floor ms | x floor |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in cases:
        lines.append(f"| {c['batch']} | {c['variant']} | {c['engine_step_ms']:.3f} "
                     f"({c['engine_step_median_ms']:.3f}) | "
                     f"{c.get('graph_replay_ms') or float('nan'):.3f} | {c['draw_ms']:.3f} | "
                     f"{c.get('host_ms', float('nan')):.3f} | {c['bench_floor_ms']:.3f} | "
                     f"{c['engine_over_floor']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_llama_shape_args(ap, seq=False)
    add_decode_shape_args(ap)
    ap.add_argument("--steps", type=int, default=20, help="engine steps timed per case")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="engine settings compared (ours, aten_attention and baseline are "
                         "profiled by category)")
    ap.add_argument("--fp8", choices=("block", "channel"), default=None,
                    help="the decoder linears in FP8 (inference/fp8: Fp8Linears with these "
                         "scales; decode products on --fp8-kernel)")
    ap.add_argument("--fp8-kernel", default="tma",
                    help="gemm.DECODE_KERNEL of the FP8 decode products (tma: the norms and "
                         "SwiGLU write the e4m3 copies it reads, as in the engine's generate)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.new < 16:
        ap.error("--new must be >= 16 (rows decode new/2 tokens; the timing needs a few)")

    import parallel_models as pm

    pm.init_parallel()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg, folder = save_llama_model(args, max_positions=max(8192, 2 * (args.prompt + args.new)))
    model = pm.LlamaForCausalLMRmPad.from_pretrained(folder, dtype=dtype)
    fp8 = None
    if args.fp8:
        from parallel_models.inference.fp8 import Fp8Linears, gemm

        gemm.DECODE_KERNEL = args.fp8_kernel
        fp8 = Fp8Linears(model, args.fp8, active=True)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
           "args": vars(args), "cases": [], "attention_micro": [], "errors": []}
    t0 = time.perf_counter()
    with torch.no_grad(), fp8.enabled() if fp8 is not None else contextlib.nullcontext():
        for batch in args.batches:
            for variant in args.variants:
                try:
                    with variant_options(variant):
                        case = run_case(args, cfg, model, dev, batch, variant)
                    res["cases"].append(case)
                    print(table(case), flush=True)
                except Exception as exc:  # noqa: BLE001 - record it, run the next case
                    res["errors"].append(f"batch {batch} {variant}: {type(exc).__name__}: {exc}")
                    traceback.print_exc()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                if args.out:  # as it goes: a run cut short still leaves its cases
                    with open(args.out, "w") as f:
                        json.dump(res, f, indent=1)
            if dev.type == "cuda":
                for context in (args.prompt + args.new // 2, 2048):
                    try:
                        micro = attention_micro(cfg, batch, context, max(context, args.prompt
                                                                           + args.new), dev, dtype)
                        res["attention_micro"].append(micro)
                    except Exception as exc:  # noqa: BLE001
                        res["errors"].append(f"micro {batch}x{context}: {type(exc).__name__}: {exc}")
                        traceback.print_exc()
                    torch.cuda.empty_cache()
    res["seconds"] = time.perf_counter() - t0
    report(res, args.out)
    if res["attention_micro"]:
        print("\n| batch | context | KV floor us | split-KV triton us (auto split) | eager 1-call "
              "us | aten flash + KV write us | split 64 / 128 / 256 / 512 us | max abs diff |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- |")
        for m in res["attention_micro"]:
            fixed = " / ".join(f"{m[f'split_{s}_us']:.1f}" for s in (64, 128, 256, 512))
            print(f"| {m['batch']} | {m['context']} | {m['floor_us']:.1f} | "
                  f"{m['split_kv_triton_us']:.1f} ({m['auto_split']}) | "
                  f"{m['split_kv_eager_us']:.1f} | "
                  f"{m['aten_flash_plus_kv_write_us']:.1f} | {fixed} | {m['max_abs_diff']:.3g} |")
    for case in res["cases"]:
        if "categories" in case:
            print("\n" + table(case))
    print("\n" + summary(res["cases"]))
    if res["errors"]:
        print("ERRORS:", *res["errors"], sep="\n  ")
    pm.destroy_parallel()


if __name__ == "__main__":
    main()
