"""Pipeline-parallel efficiency: PP=2 1F1B fwd+bwd per-GPU throughput and the measured bubble.

    torchrun --nproc-per-node 2 bench/pp_bench.py --microbatches 16 [--layers-per-stage 17 15]
        [--tp1-json tp1.json] [--out pp.json]

The Llama-3-8B shape of tp_bench.py (bf16, random weights), split in 2 stages (stage 0: the
embedding, stage 1: norm + the 128256x4096 LM head + loss), run through our own pipeline code
(parallel_models.pipeline.forward_backward -> megatron-core's 1F1B schedule): ``--microbatches``
microbatches of ``--tokens-per-gpu`` tokens each, the same tokens per microbatch as tp_bench's
TP=1 step, so per-GPU tokens/s compare directly (``--tp1-json``: share of TP=1).
Bubble, measured per stage: CUDA events around each microbatch's forward_step and backward_step
(megatron's schedule functions, wrapped), busy = their sum, bubble = 1 - busy / step wall time,
printed beside the ideal (p - 1) / (m + p - 1).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from common import (LLAMA3_8B, add_llama_shape_args, add_scaling_args, build_random_llama,
                    report, timed_steps)
from tp_bench import add_tp1_share


def _wrap_schedule_steps(events: list):
    """Record a CUDA event pair around every forward_step / backward_step megatron's schedules
    call (module globals, looked up at call time)."""
    from megatron.core.pipeline_parallel import schedules

    def wrap(name):
        fn = getattr(schedules, name)

        def timed(*a, **kw):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = fn(*a, **kw)
            e.record()
            events.append((name, s, e))
            return out
        setattr(schedules, name, timed)

    wrap("forward_step")
    wrap("backward_step")


def main():
    p = argparse.ArgumentParser()
    add_llama_shape_args(p, shape=LLAMA3_8B)
    add_scaling_args(p)
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--layers-per-stage", type=int, nargs=2, default=None)
    args = p.parse_args()
    if args.max_connections_1:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"

    import parallel_models as pm
    from parallel_models.pipeline import forward_backward
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits

    pp = 2
    pm.init_parallel(pipeline_parallel_size=pp)
    dev = pm.compute_device()
    model = build_random_llama(args, pm.LlamaForCausalLMRmPadPP, 1234 + dist.get_rank(),
                               layers_per_stage=args.layers_per_stage)

    n = args.tokens_per_gpu
    g = torch.Generator(device=dev).manual_seed(0)
    cu = torch.arange(0, n + 1, args.seq, dtype=torch.int32, device=dev)
    microbatches = [{"input_ids": torch.randint(0, args.vocab, (n,), device=dev, generator=g),
                     "cu_seqlens": cu} for _ in range(args.microbatches)]

    def loss_fn(out, mb):
        lp = log_probs_from_packed_logits(out.logits, mb["input_ids"], mb["cu_seqlens"])
        return -lp.sum(), torch.tensor(lp.numel(), device=dev), {}

    events: list = []
    _wrap_schedule_steps(events)

    def step():
        forward_backward(model, microbatches, loss_fn)

    busy, fwd, bwd = [], [], []

    def read_events():  # this step's forward / backward busy time on this stage
        f = sum(s.elapsed_time(e) for k, s, e in events if k == "forward_step") / 1e3
        bw = sum(s.elapsed_time(e) for k, s, e in events if k == "backward_step") / 1e3
        fwd.append(f)
        bwd.append(bw)
        busy.append(f + bw)

    walls = timed_steps(step, args.iters, before=events.clear, after=read_events)
    i = sorted(range(len(walls)), key=walls.__getitem__)[len(walls) // 2]  # the median step
    t = walls[i]
    stage = {"pp_rank": dist.get_rank(), "layers": len(model.model.layers),
             "forward_s": fwd[i], "backward_s": bwd[i], "busy_s": busy[i],
             "bubble_measured": 1 - busy[i] / t,
             "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    stages = [None] * pp
    dist.all_gather_object(stages, stage)
    tokens = n * args.microbatches
    res = {"pp": pp, "microbatches": args.microbatches, "layers_per_stage":
           args.layers_per_stage or [args.layers // pp] * pp,
           "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "cuda_device_max_connections":
           os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), "tokens_per_step": tokens, "step_s": t,
           "steps_s": walls, "tokens_per_s": tokens / t, "tokens_per_s_per_gpu": tokens / t / pp,
           "bubble_ideal": (pp - 1) / (args.microbatches + pp - 1), "stages": stages,
           "args": vars(args)}
    if dist.get_rank() == 0:
        add_tp1_share(res, args.tp1_json)
        report(res, args.out)
        for st in stages:
            print(f"stage {st['pp_rank']} ({st['layers']} layers): bubble measured "
                  f"{st['bubble_measured']:.3f} (ideal {res['bubble_ideal']:.3f}), "
                  f"peak {st['peak_gib']:.1f} GiB; {res['tokens_per_s_per_gpu']:.0f} tokens/s/GPU")
    pm.destroy_parallel()


if __name__ == "__main__":
    main()
