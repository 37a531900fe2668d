"""Demo: a tiny model of a registered family (default Llama) built on the spot, loaded
tensor-parallel, checked against transformers.

    torchrun --nproc-per-node 2 -m parallel_models.demo   (or plain `python -m ...` for TP=1)
"""

from __future__ import annotations

import argparse
import os
import tempfile

from parallel_models.cli_support import add_version_argument, quiet_third_party


def main(argv=None) -> None:
    quiet_third_party()
    parser = argparse.ArgumentParser(prog="python -m parallel_models.demo", description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    from parallel_models.llama.families import all_families  # light: no torch

    parser.add_argument("--family", choices=[f.model_type for f in all_families()],
                        default="llama", help="an HF model_type of a registered family")
    parser.add_argument("--sequence-parallel", action="store_true")
    add_version_argument(parser)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    import parallel_models as pm
    from parallel_models.testing import save_tiny_hf_model
    from parallel_models.utils.padding import position_ids_from_attention_mask

    world = int(os.environ.get("WORLD_SIZE", "1"))
    pm.init_parallel(tensor_parallel_size=world, sequence_parallel=args.sequence_parallel)
    rank = dist.get_rank()
    folder = os.path.join(tempfile.gettempdir(), f"parallel_models_demo_{args.family}")
    if rank == 0:
        save_tiny_hf_model(folder, args.family, seed=0)
    dist.barrier()

    model = pm.AutoModelForCausalLM.from_pretrained(folder, rmpad=True, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :10] = 0  # a left-padded row
    packed = pm.pack_padded_batch(ids, mask)
    with torch.no_grad():
        logits = model(packed.input_ids, packed.cu_seqlens, full_vocab=True).logits
    if rank == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with torch.no_grad():
            ref = hf(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_attention_mask(mask)).logits
        err = (ref[mask.bool()] - logits).abs().max().item()
        print(f"{type(model).__name__} TP={world} SP={model.sequence_parallel}: "
              f"{packed.input_ids.numel()} packed tokens, max |logits - transformers| = {err:.2e}")
        if err > 1e-4:
            raise SystemExit("mismatch against transformers")
    pm.destroy_parallel()


if __name__ == "__main__":
    main()
