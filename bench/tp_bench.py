"""Tensor-parallel scaling: per-GPU fwd+bwd throughput at TP=1 and TP=2 (+ sequence parallel).

    torchrun --nproc-per-node 2 bench/tp_bench.py --tp 1 [--out tp1.json]
    torchrun --nproc-per-node 2 bench/tp_bench.py --tp 2 [--sequence-parallel] [--out tp2.json]
        [--overlap-chunks K] [--max-connections-1] [--tp1-json tp1.json]

``--overlap-chunks K``: the row-parallel output reduction overlaps its GEMM in K token chunks
(parallel_models/llama/layers/row_overlap.py). ``--max-connections-1``: sets
CUDA_DEVICE_MAX_CONNECTIONS=1 before CUDA starts (megatron relies on it to order comm before
compute). ``--tp1-json``: a
TP=1 run's output; adds ``share_of_tp1_per_gpu`` (this run's per-GPU tokens/s over TP=1's).
``--grad-buffer ddp`` (default): the model in megatron DDP as training runs it (fp32 gradient
buffers); ``plain``: gradients in bf16 ``.grad``. ``--compare-wgrad-fusion``: also timed with the
weight-gradient GEMMs accumulating straight into the buffers (``utils/wgrad_fusion.py``), rounds
alternated. ``--compare-grad-first-write``: also timed with megatron's zeroed buffers + adds
(``zeroed_buffers_step_s``) against the first backward writing them (``step_s``, the default:
``utils/grad_first_write.py``), rounds alternated; with ddp every step starts with
``zero_grad_buffer()`` as training does. ``--compare-triton-elementwise``: SwiGLU / RMSNorm
through the opt-in Triton kernels (``step_s``) and through ``torch.compile``
(``compiled_elementwise_step_s``), rounds alternated.

Llama-3-8B shape by default (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336,
vocab 128256), bf16, random weights built directly on the GPUs (no checkpoint). Every GPU keeps
the same number of tokens: at TP=1 each GPU runs its own model on ``--tokens-per-gpu`` tokens
(the two GPUs run side by side, no communication); at TP=2 the pair runs one model on twice as
many tokens. Per-GPU throughput = tokens / s / GPUs of the model. CUDA events, median of repeats.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from common import (LLAMA3_8B, add_llama_shape_args, add_scaling_args, build_random_llama,
                    gap_table, kernel_table, matmul_peak_tflops, report, timed_steps)


def add_tp1_share(res: dict, tp1_json: str | None) -> None:
    """``share_of_tp1_per_gpu``: per-GPU tokens/s over the TP=1 run saved in ``tp1_json``."""
    if tp1_json:
        with open(tp1_json) as f:
            base = json.load(f)
        res["tp1_tokens_per_s_per_gpu"] = base["tokens_per_s_per_gpu"]
        res["share_of_tp1_per_gpu"] = res["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
        print(f"per-GPU share of TP=1: {res['share_of_tp1_per_gpu']:.3f}")


def _median(xs: list[float]) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    add_llama_shape_args(p, shape=LLAMA3_8B)
    add_scaling_args(p)
    p.add_argument("--profile", default=None, help="file: kernel table of one step (rank 0)")
    p.add_argument("--gaps", default=None,
                   help="file: where the GPU idles in one step and what the host ran then "
                        "(rank 0; common.gap_table)")
    p.add_argument("--overlap-chunks", type=int, default=0)
    p.add_argument("--grad-buffer", choices=["ddp", "plain"], default="ddp",
                   help="ddp: gradients into megatron DDP's fp32 buffers as training runs; "
                        "plain: bf16 .grad")
    p.add_argument("--compare-wgrad-fusion", action="store_true",
                   help="with ddp: also time the weight-gradient GEMMs fused into the buffers "
                        "(utils/wgrad_fusion.py), rounds alternated")
    p.add_argument("--compare-grad-first-write", action="store_true",
                   help="with ddp: also time megatron's zeroed buffers + adds against the "
                        "first backward writing them (utils/grad_first_write.py, the default), "
                        "rounds alternated")
    p.add_argument("--compare-triton-elementwise", action="store_true",
                   help="time SwiGLU / RMSNorm through the opt-in Triton kernels and compiled "
                        "(llama/layers/elementwise_triton.py), rounds alternated")
    args = p.parse_args()
    if args.max_connections_1:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"

    import parallel_models as pm
    from parallel_models.options import set_options

    set_options({"tp_overlap_chunks": args.overlap_chunks})  # read when the layers are built
    from parallel_models.llama.layers import elementwise_triton as et
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits

    pm.init_parallel(tensor_parallel_size=args.tp, sequence_parallel=args.sequence_parallel)
    dev = pm.compute_device()
    # the same weights on the TP group's ranks
    model = build_random_llama(args, pm.LlamaForCausalLMRmPad, 1234)
    fused = 0
    if args.grad_buffer == "ddp":
        from parallel_models.utils import wgrad_fusion
        from parallel_models.utils.optimizer import wrap_for_training

        [model] = wrap_for_training(model)
        if args.compare_wgrad_fusion:
            fused = wgrad_fusion.enable([model], on=True)

    tokens = args.tokens_per_gpu * args.tp
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, args.vocab, (tokens,), device=dev, generator=g)
    cu = torch.arange(0, tokens + 1, args.seq, dtype=torch.int32, device=dev)

    overlap_check = None
    if args.overlap_chunks > 1 and args.tp > 1:
        # the chunked NCCL path against megatron's plain one on the same input (stream races
        # would show here): max |logits difference|, bf16
        from parallel_models.llama.layers.row_overlap import set_tp_overlap_chunks

        chunked = model(ids, cu).logits.detach()
        set_tp_overlap_chunks(model, 0)
        plain = model(ids, cu).logits.detach()
        set_tp_overlap_chunks(model, args.overlap_chunks)
        overlap_check = float((chunked.float() - plain.float()).abs().max())
        del chunked, plain

    def step():
        if args.grad_buffer == "ddp":
            model.zero_grad_buffer()  # as every training step starts
        logits = model(ids, cu).logits
        loss = -log_probs_from_packed_logits(logits, ids, cu).sum() / tokens
        loss.backward()

    def alternated(switch):
        """Step times with ``switch(False)`` (the default) and ``switch(True)``, 3 rounds
        alternated in this process; leaves the default on."""
        times = {False: [], True: []}
        for r in range(3):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                switch(on)
                times[on].extend(timed_steps(step, args.iters))
        switch(False)
        return times[False], times[True]

    fused_times, compiled_times, zeroed_times = [], [], []
    if fused:  # unfused (the default) and fused
        times, fused_times = alternated(lambda on: wgrad_fusion.enable([model], on=on))
    elif args.compare_grad_first_write and args.grad_buffer == "ddp":
        from parallel_models.utils import grad_first_write

        # first write (the default) and megatron's memset + adds
        times, zeroed_times = alternated(lambda on: grad_first_write.enable(model, on=not on))
    elif args.compare_triton_elementwise:  # the Triton kernels (step_s) and the compiled path
        times, compiled_times = alternated(lambda on: et.set_enabled(not on))
    else:
        times = timed_steps(step, args.iters)
    t = _median(times)
    # parameters that multiply (the input embedding is a lookup): layers + LM head
    head_dim = args.hidden // args.heads
    per_layer = (args.hidden * (args.heads + 2 * args.kv_heads) * head_dim
                 + args.heads * head_dim * args.hidden + 3 * args.hidden * args.intermediate)
    n_matmul = args.layers * per_layer + args.vocab * args.hidden
    flops = 6 * n_matmul * tokens + 6 * args.layers * args.hidden * (tokens // args.seq) * args.seq**2
    res = {"tp": args.tp, "sequence_parallel": args.sequence_parallel,
           "overlap_chunks": args.overlap_chunks, "overlap_vs_plain_logits_max_abs": overlap_check,
           "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "grad_buffer": args.grad_buffer, "fused_wgrad_linears": fused,
           "step_s_all": times, "fused_wgrad_step_s_all": fused_times,
           "fused_wgrad_step_s": _median(fused_times),
           "zeroed_buffers_step_s_all": zeroed_times,
           "zeroed_buffers_step_s": _median(zeroed_times),
           "triton_elementwise": et.enabled() and et.available(),
           "compiled_elementwise_step_s_all": compiled_times,
           "compiled_elementwise_step_s": _median(compiled_times),
           "tokens_per_step": tokens, "step_s": t, "tokens_per_s": tokens / t,
           "tokens_per_s_per_gpu": tokens / t / args.tp,
           "tflops_per_gpu": flops / t / 1e12 / args.tp,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "args": vars(args)}
    if args.profile and dist.get_rank() == 0:
        kernel_table(step, args.profile, rows=30)
    elif args.profile:  # the other ranks take part in the same two steps (collectives)
        step()
        step()
    if args.gaps and dist.get_rank() == 0:
        res["gaps"] = gap_table(step, args.gaps)
    elif args.gaps:
        step()
        step()
    if dist.get_rank() == 0:
        res["matmul_peak_tflops"] = matmul_peak_tflops(dev)
        res["share_of_matmul_peak"] = res["tflops_per_gpu"] / res["matmul_peak_tflops"]
        add_tp1_share(res, args.tp1_json)
        report(res, args.out)
    pm.destroy_parallel()


if __name__ == "__main__":
    main()
