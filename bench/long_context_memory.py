"""What the long-context training step's forward + backward holds at its peak, counted on the CPU
(no GPU needed): ``bench/long_context.py``'s step (CP ranks, full recomputation, megatron DDP's
fp32 gradient buffers, the token-sum next-token loss) on a scaled-down shape, every tensor the
step allocates tracked until it is freed.

    python -m torch.distributed.run --nproc-per-node 2 bench/long_context_memory.py
    python -m torch.distributed.run --nproc-per-node 2 bench/long_context_memory.py --gathered

The default shape is the Llama-3-8B one with tokens, hidden, MLP, heads and vocabulary each
divided by 4 (2 layers): every per-token tensor (hidden states, MLP intermediates, K/V, logits,
weights) is then 1/16 of its 8B size, so the printed MiB times 16 are the 8B / 32k GiB / 64 (the
log-prob chunks too: their bytes are divided by 16, 256 of the 4,096 tokens per rank, as 1,024
of 16,384 at 8B); the 30 more layer inputs of the 8B model (3.75 GiB) come on top.
``--gathered``: the loss as the bench computed it before ``utils/chunked_logprob.py`` (the
CP-gathered logits of the whole sequence through ``log_probs_from_packed_logits``).

Counting: a ``TorchDispatchMode`` records the storage of every tensor an op returns (views of a
known storage are not counted twice) and drops it when the storage is freed; the peak of the sum,
the largest live tensors at that moment and the peak of each phase (the layers' forward, the
head's forward, its backward, the layers' backward; under CP) are printed (rank 0), as one JSON
line. Not counted:
what existed before the step (weights, DDP's gradient buffers); on the CPU the vocab-parallel
math runs eagerly (on CUDA it is compiled: fewer float32 temporaries) and torch's lower-right
causal SDPA bias is materialized as a mask (on CUDA: the flash kernel, no mask).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPE_8B_QUARTER = dict(hidden_size=1024, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=2, intermediate_size=3584, vocab_size=32064)


class LiveTensors(TorchDispatchMode):
    """Bytes of the storages created under the mode and still alive; the peak and what made it."""

    def __init__(self, top: int = 12):
        super().__init__()
        self.live: dict[int, tuple] = {}
        self.peak, self.at_peak, self.top = 0, [], top
        self.phase, self.phase_peaks = "forward", {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()  # views and in-place results share an input's storage
            if storage.nbytes() and key not in self.live and key not in inputs:
                self.live[key] = (StorageWeakRef(storage), storage.nbytes(),
                                  f"{func.__name__} {list(t.shape)} {str(t.dtype)[6:]}")
        total = sum(v[1] for v in self.live.values())
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), total)
        if total > self.peak:
            self.peak = total
            biggest = sorted(self.live.values(), key=lambda v: -v[1])[:self.top]
            self.at_peak = [(label, nbytes) for _, nbytes, label in biggest]
        return out


def _bias_outside_the_mode():
    """torch's ``CausalBias`` (a Tensor subclass) cannot be built while a dispatch mode sees its
    storage-less base tensor: the CP attention builds it with the mode paused."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.utils._python_dispatch import _disable_current_modes

    from parallel_models.llama.layers import context_parallel

    def build(*sizes):
        with _disable_current_modes():
            return causal_lower_right(*sizes)

    context_parallel.causal_lower_right = build


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=8192, help="sequence tokens (8B run / 4)")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="full")
    p.add_argument("--gathered", action="store_true",
                   help="the old loss: log-probs of the CP-gathered logits")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--layers", type=int, default=2,
                   help="decoder layers (the forward's peak stays one layer's with recompute)")
    args = p.parse_args(argv)

    import parallel_models as pm
    from bench.long_context import build_model, next_token_loss
    from parallel_models.llama.layers.recompute import set_recompute
    from parallel_models.pipeline import forward_backward
    from parallel_models.utils.optimizer import wrap_for_training
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits

    def gathered_loss(out, mb):
        logp = log_probs_from_packed_logits(out.logits, mb["input_ids"], mb["cu_seqlens"])
        return -logp.sum(), torch.tensor(logp.numel(), dtype=torch.int), {}

    from parallel_models.utils import chunked_logprob

    # the 8B run's chunks are 1/16 of a rank's tokens; here too (the chunk's bytes scale as V)
    chunked_logprob.LOGITS_CHUNK_BYTES //= 16
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    pm.init_parallel(context_parallel_size=args.cp)
    model = build_model(dict(SHAPE_8B_QUARTER, num_hidden_layers=args.layers), args.seq, dtype)
    set_recompute(model, args.recompute)
    chunks = wrap_for_training([model], use_distributed_optimizer=True)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPE_8B_QUARTER["vocab_size"], (args.seq,), generator=gen)
    mb = {"input_ids": ids, "cu_seqlens": torch.tensor([0, args.seq], dtype=torch.int32)}
    _bias_outside_the_mode()
    tracker = LiveTensors()
    loss = gathered_loss if args.gathered else next_token_loss

    def phased_loss(out, batch):  # the head's forward, its backward, then the layers'
        tracker.phase = "head_forward"
        hidden = getattr(out, "hidden", None)
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(lambda g: setattr(tracker, "phase", "layers_backward"))
        result = loss(out, batch)
        tracker.phase = "head_backward"
        return result

    with tracker:
        forward_backward(chunks, [dict(mb)], phased_loss)
    mib = 2 ** 20
    line = {"case": f"seq{args.seq}-layers{args.layers}-cp{args.cp}-recompute_{args.recompute}-"
                    f"{args.dtype}-"
                    f"{'gathered' if args.gathered else 'chunked'}",
            "peak_mib": round(tracker.peak / mib, 1),
            "x16_gib_at_8b": round(tracker.peak * 16 / 2 ** 30, 2),
            "phase_peaks_x16_gib": {k: round(v * 16 / 2 ** 30, 2)
                                    for k, v in tracker.phase_peaks.items()},
            "at_peak": [[label, round(nbytes / mib, 1)] for label, nbytes in tracker.at_peak]}
    if dist.get_rank() == 0:
        print(json.dumps(line), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
