"""Long-context training step (issue 33 item 5): one actor training step (forward + backward +
optimizer) of the Llama-3-8B shape on ONE 32,768-token sequence at context parallel size 2 on 2
GPUs, with activation recomputation; peak memory per phase and tokens/s.

    torchrun --nproc-per-node 2 bench/long_context.py                       # 8B, 32k, CP=2, full
    torchrun --nproc-per-node 2 bench/long_context.py --recompute selective --out lc.json
    torchrun --nproc-per-node 2 bench/long_context.py --optimizer-offload-fraction 0.5
    python -m torch.distributed.run --nproc-per-node 2 bench/long_context.py --tiny  # CPU smoke

What runs on each rank: ``init_parallel(context_parallel_size=2)``; our Llama (random bf16
weights of the 8B shape drawn on the device, rope theta 500000, positions up to ``--seq``) with
``set_recompute(--recompute)``; ``build_optimizer``: megatron-core DDP + Adam on the distributed
optimizer (its states sharded over the CP x DP ranks) with ``--optimizer-offload-fraction`` of
them on the host (megatron-core's HybridDeviceOptimizer; default 1.0: an 8B model's fp32 states do
not fit beside its weights and fp32 gradient buffer on an 80 GB card); then ``--steps`` times
``pipeline.train_step`` on one packed sequence of ``--seq`` random tokens (each CP rank holds two
mirrored chunks of it) with the token-mean next-token cross-entropy.

Printed: one JSON line per case (step): ``tokens_per_s`` (the sequence's tokens / step time),
``step_s``, and per phase (``forward_backward``, ``optimizer``) its seconds and the peak GiB
allocated on this rank's device during it (``torch.cuda.max_memory_allocated``, reset before each
phase; 0 on the CPU), the maximum over the ranks. The first ``--warmup`` steps are reported too,
marked ``"warmup": true``. ``--tiny``: a 2-layer toy shape on a 256-token sequence (fp32; gloo on
the CPU works), the smoke the test suite runs (with ``--logits-chunk-mib 0.05``: 25-token chunks
of the log-prob path, as the 8B shape's 16,384 tokens per rank take 1,024-token chunks).

Memory per rank at the 8B shape, 32k tokens, CP = 2 (what the peak is made of, docs in
``utils/chunked_logprob.py``): bf16 weights 14.96 GiB, megatron DDP's fp32 gradient buffer
29.92 GiB, the distributed optimizer's fp32 main-weight shard 14.96 GiB (it stays on the device
with the states offloaded), 32 layer inputs of 128 MiB each (full recomputation), then the
transient of one recomputed layer's backward or of the chunked log-prob's backward (about 5 GiB,
``bench/long_context_memory.py`` counts them on the CPU): about 69 GiB in ``forward_backward``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

SHAPE_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=14336, vocab_size=128256)
SHAPE_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=512)


def build_model(shape: dict, seq: int, dtype: torch.dtype, seed: int = 0):
    """Our Llama of ``shape`` with random weights (normal 0.02, norms 1) drawn on the device."""
    from transformers import LlamaConfig

    import parallel_models as pm
    from parallel_models.config import ModelConfig

    hf_cfg = LlamaConfig(**shape, max_position_embeddings=max(seq, 8192), rope_theta=500000.0,
                         architectures=["LlamaForCausalLM"])
    cls = pm.get_model_class("LlamaForCausalLM", "causal_lm", True)
    model = cls(ModelConfig.from_hf(hf_cfg), dtype=dtype)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            prm.fill_(1.0) if "norm" in name else prm.normal_(0.0, 0.02, generator=gen)
    return model


def next_token_loss(out, mb):
    """Token-sum next-token cross-entropy (the schedule divides by the tokens) of the whole
    sequence, as the RL roles compute it: under CP each rank's log-probs come from its own tokens
    and are gathered; for more tokens than one chunk (``heads/lm_output.py``) the head and the
    vocab-parallel log-prob run a chunk of tokens at a time (``utils/chunked_logprob.py``); the
    logits of the whole sequence are never gathered."""
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits

    if hasattr(out, "next_token_log_probs"):  # CP, or more tokens than one chunk
        logp = out.next_token_log_probs(mb["input_ids"], mb["cu_seqlens"])
    else:
        logp = log_probs_from_packed_logits(out.logits, mb["input_ids"], mb["cu_seqlens"])
    return -logp.sum(), torch.tensor(logp.numel(), dtype=torch.int), {}


class PhaseMemory:
    """Seconds and peak allocated GiB of each phase (CUDA; the CPU reports 0 GiB)."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.phases: dict[str, dict] = {}

    def __call__(self, name: str, fn):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        result = fn()
        if self.cuda:
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.cuda else 0.0
        self.phases[name] = {"s": time.perf_counter() - t0, "peak_gib": peak}
        return result


def ranks_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64,
                     device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true", help="toy shape, 256 tokens, fp32 (CPU smoke)")
    p.add_argument("--seq", type=int, default=None, help="sequence tokens (default 32768)")
    p.add_argument("--cp", type=int, default=2, help="context_parallel_size")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="full")
    p.add_argument("--optimizer-offload-fraction", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--logits-chunk-mib", type=float, default=None,
                   help="float32 MiB of logits per token chunk of the log-prob path (default "
                        "utils/chunked_logprob.LOGITS_CHUNK_BYTES: 512)")
    p.add_argument("--device-mib", type=int, default=0,
                   help="run as if each card had this many MiB (81559: an H100 80GB on a larger "
                        "card; bench/device_envelope.py)")
    p.add_argument("--out", default=None, help="also write the JSON lines here (rank 0)")
    args = p.parse_args(argv)
    envelope = {}
    if args.device_mib:
        from device_envelope import apply

        envelope = apply(args.device_mib)

    import parallel_models as pm
    from parallel_models.llama.layers.recompute import set_recompute
    from parallel_models.pipeline import forward_backward
    from parallel_models.utils.optimizer import (OptimConfig, build_optimizer, optimizer_step,
                                                 zero_grads)

    if args.logits_chunk_mib is not None:
        from parallel_models.utils import chunked_logprob

        chunked_logprob.LOGITS_CHUNK_BYTES = max(1, int(args.logits_chunk_mib * 2**20))
    cuda = torch.cuda.is_available()
    shape = SHAPE_TINY if args.tiny else SHAPE_8B
    seq = args.seq or (256 if args.tiny else 32768)
    dtype = torch.bfloat16 if cuda and not args.tiny else torch.float32
    pm.init_parallel(tensor_parallel_size=args.tp, context_parallel_size=args.cp)
    model = build_model(shape, seq, dtype)
    set_recompute(model, args.recompute)
    state = build_optimizer([model], OptimConfig(
        lr=1e-6, use_distributed_optimizer=True,
        optimizer_offload_fraction=args.optimizer_offload_fraction))
    device = model.device
    gen = torch.Generator().manual_seed(1)  # the same sequence on every rank
    ids = torch.randint(0, shape["vocab_size"], (seq,), generator=gen).to(device)
    mb = {"input_ids": ids, "cu_seqlens": torch.tensor([0, seq], dtype=torch.int32,
                                                       device=device)}
    lines = []
    for step in range(args.warmup + args.steps):
        memory = PhaseMemory()  # pipeline.train_step's two halves, timed apart
        t0 = time.perf_counter()
        zero_grads(state)
        memory("forward_backward",
               lambda: forward_backward(state.chunks, [dict(mb)], next_token_loss))
        out = memory("optimizer", lambda: optimizer_step(state))
        step_s = ranks_max(time.perf_counter() - t0)
        phases = {k: {"s": ranks_max(v["s"]), "peak_gib": ranks_max(v["peak_gib"])}
                  for k, v in memory.phases.items()}
        line = {"case": f"{'tiny' if args.tiny else '8b'}-seq{seq}-cp{args.cp}-tp{args.tp}-"
                        f"recompute_{args.recompute}-offload{args.optimizer_offload_fraction:g}",
                "step": step + 1, "warmup": step < args.warmup, "tokens": seq,
                "step_s": step_s, "tokens_per_s": seq / step_s,
                "grad_norm": out["grad_norm"], "update_ok": out["update_ok"],
                "peak_gib": max(v["peak_gib"] for v in phases.values()), "phases": phases,
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "world_size": dist.get_world_size(), "device_envelope": envelope}
        if dist.get_rank() == 0:
            print(json.dumps(line), flush=True)
        lines.append(line)
    if args.out and dist.get_rank() == 0:
        with open(args.out, "w") as f:
            f.write("".join(json.dumps(x) + "\n" for x in lines))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
