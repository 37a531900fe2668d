"""GPU correctness check (and a first throughput reading) of the parallel models.

    torchrun --nproc-per-node N bench/gpu_check.py [--out results.json]

On N GPUs (TP=N): fp32 and bf16 logits of Llama (GQA, llama3 rope) and Qwen2 (qkv bias, tied)
vs transformers on the same weights (padded and RmPad), which attention kernel ran, greedy
generation vs transformers.generate, and a fwd+bwd tokens/s reading of ours vs transformers SDPA
on rank 0's GPU (TP=1 only).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from common import report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--throughput", action="store_true")
    args = parser.parse_args()

    import parallel_models as pm
    from parallel_models.llama.layers.attention_kernels import available_backend
    from parallel_models.inference.generation import SamplingParams, generate
    from parallel_models.testing import save_tiny_hf_model
    from parallel_models.utils.padding import pack_padded_batch, position_ids_from_attention_mask
    from transformers import AutoModelForCausalLM

    world = int(os.environ.get("WORLD_SIZE", "1"))
    pm.init_parallel(tensor_parallel_size=world, sequence_parallel=world > 1)
    rank = dist.get_rank()
    dev = pm.compute_device()
    results = {"world": world, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import megatron.core

    results["megatron_core"] = megatron.core.__version__
    root = "/tmp/pm_gpu_check"
    shapes = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=1001)
    if rank == 0:
        for fam in ("llama", "qwen2"):
            save_tiny_hf_model(f"{root}/{fam}", fam, seed=0, **shapes)
    dist.barrier()
    g = torch.Generator().manual_seed(0)
    lengths = [100, 37, 64, 5]
    S = max(lengths)
    ids = torch.randint(0, 1000, (4, S), generator=g)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, S - n:] = 1  # left padding
    ids, mask = ids.to(dev), mask.to(dev)
    pos = position_ids_from_attention_mask(mask)
    valid = mask.bool()
    for fam in ("llama", "qwen2"):
        path = f"{root}/{fam}"
        for dtype in (torch.float32, torch.bfloat16):
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(dev)
            with torch.no_grad():
                ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()[valid]
            for rmpad in (False, True):
                model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=rmpad, dtype=dtype)
                with torch.no_grad():
                    if rmpad:
                        p = pack_padded_batch(ids, mask)
                        got = model(p.input_ids, p.cu_seqlens, full_vocab=True).logits.float()
                    else:
                        got = model(ids, attention_mask=mask, full_vocab=True).logits.float()[valid]
                key = f"{fam}-{str(dtype).split('.')[-1]}-{'rmpad' if rmpad else 'padded'}"
                results[key] = {"max_abs": (got - ref).abs().max().item(),
                                "rel": ((got - ref).norm() / ref.norm()).item(),
                                "backend": available_backend(dev, dtype)}
            del hf
        model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev)
        prompts = [ids[b, S - n:].tolist() for b, n in enumerate(lengths)]
        out = generate(model, prompts, SamplingParams(max_new_tokens=16, greedy=True))
        same = []
        for b, prompt in enumerate(prompts):
            refg = hf.generate(torch.tensor([prompt], device=dev), max_new_tokens=16, do_sample=False,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=dev),
                               pad_token_id=0)
            same.append(refg[0, len(prompt):].tolist() == out.responses[b].tolist())
        results[f"{fam}-greedy-identical"] = same
    if rank == 0:
        report(results, args.out)
    pm.destroy_parallel()


if __name__ == "__main__":
    main()
