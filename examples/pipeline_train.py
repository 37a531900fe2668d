"""Train a small Llama for a few steps with pipeline parallelism (PP=2 on two CPU ranks), the
README's "Pipeline parallel and training" example as a script that runs as pasted:

    .venv/bin/torchrun --nproc-per-node 2 examples/pipeline_train.py [--tp 1 --pp 2 --steps 3]

It builds a tiny random Llama (transformers, saved locally), loads this rank's pipeline stage,
and runs optimizer steps of next-token cross-entropy over packed microbatches; rank 0 prints the
layout and the loss per step.
"""

from __future__ import annotations

import argparse
import os

from parallel_models.cli_support import quiet_third_party

quiet_third_party()  # before megatron-core's import-time notes about optional GPU extras

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import parallel_models as pm  # noqa: E402
from parallel_models.pipeline import train_step  # noqa: E402
from parallel_models.testing import save_tiny_hf_model  # noqa: E402
from parallel_models.utils.optimizer import OptimConfig, build_optimizer  # noqa: E402
from parallel_models.utils.padding import pack_padded_batch  # noqa: E402
from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits  # noqa: E402


def next_token_loss(out, mb):
    """Summed next-token negative log-likelihood of a packed microbatch (any TP: the logits are
    this rank's vocab slice) and the number of predicted tokens."""
    logp = log_probs_from_packed_logits(out.logits, mb["input_ids"], mb["cu_seqlens"])
    n = mb["input_ids"].numel() - (mb["cu_seqlens"].numel() - 1)  # no target after a last token
    loss = -logp.sum()
    return loss, torch.tensor(n), {"loss": loss.detach() / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", default="outputs/pipeline_example/model",
                        help="an HF Llama/Qwen folder; built (tiny, random) if absent")
    args = parser.parse_args()

    pm.init_parallel(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp)
    rank = dist.get_rank()
    if rank == 0 and not os.path.isfile(os.path.join(args.model, "config.json")):
        save_tiny_hf_model(args.model, "llama", num_hidden_layers=4)
    dist.barrier()
    config = pm.ModelConfig.from_hf(args.model)
    if rank == 0:
        print(pm.format_pipeline_layout(config.num_layers, args.pp))  # who holds which layers
    chunks = pm.build_pipeline_chunks(pm.LlamaForCausalLMRmPadPP, args.model, dtype="float32")
    state = build_optimizer(chunks, OptimConfig(lr=1e-3, clip_grad=1.0))

    g = torch.Generator().manual_seed(0)  # the same batch on every rank
    ids = torch.randint(0, config.vocab_size, (8, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, :6] = 0  # some left padding
    microbatches = []
    for part_ids, part_mask in zip(ids.chunk(4), mask.chunk(4)):
        p = pack_padded_batch(part_ids, part_mask)
        microbatches.append({"input_ids": p.input_ids, "cu_seqlens": p.cu_seqlens,
                             "position_ids": p.position_ids, "max_seqlen": p.max_seqlen})
    for step in range(args.steps):
        metrics = train_step(state, microbatches, next_token_loss)
        if rank == 0:
            print(f"step {step + 1}: loss {float(metrics['loss']):.4f} "
                  f"grad_norm {float(metrics['grad_norm']):.4f}")
    pm.destroy_parallel()


if __name__ == "__main__":
    main()
