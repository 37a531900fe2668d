"""Worker functions of the MoE LoRA tests beyond the PEFT comparisons of ``lora_checks``: the
expert adapters in a megatron-core distributed checkpoint, and the fsdp backend's peft LoRA on
an MoE model against the megatron backend's adapters."""

from __future__ import annotations

import torch

from tests.helpers.lora_checks import ALPHA, RANK, build_lora_chunks, peft_reference, peft_tensors


def expert_adapter_checkpoint(path: str, folder: str, tp: int, ep: int, save: bool) -> dict:
    """The adapters of an MoE LoRA model (PEFT's, nonzero B) in a megatron-core distributed
    checkpoint (``lora/checkpoint.py``'s declarations): ``save`` writes them at TP x EP;
    otherwise a fresh model at TP x EP loads them. -> the largest difference between the
    model's gathered adapters and PEFT's (rank 0)."""
    from megatron.core import dist_checkpointing

    import parallel_models as pm
    from parallel_models import cpu_shim
    from parallel_models.llama.checkpoint_utils.mcore_saver import sync_save_strategy
    from parallel_models.lora import LoraSettings, add_lora, gather_adapter_tensors
    from parallel_models.lora.checkpoint import adapter_sharded_state_dict

    pm.init_parallel(tensor_parallel_size=tp, sequence_parallel=tp > 1,
                     expert_model_parallel_size=ep)
    peft_model = peft_reference(path, "all-linear")
    if save:
        import os

        os.makedirs(folder, exist_ok=True)
        chunks = build_lora_chunks(path, "all-linear", peft_model)
        with cpu_shim.cuda_to_cpu():
            dist_checkpointing.save(adapter_sharded_state_dict(chunks[0], 0, "actor"), folder,
                                    sharded_strategy=sync_save_strategy(),
                                    validate_access_integrity=False)
    else:
        cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True,
                                 pp=True)
        chunks = pm.build_pipeline_chunks(cls, path, dtype=torch.float32)
        add_lora(chunks, LoraSettings(rank=RANK, alpha=ALPHA))
        loaded = dist_checkpointing.load(
            adapter_sharded_state_dict(chunks[0], 0, "actor", clone=True), folder)
        params = dict(chunks[0].named_parameters())
        with torch.no_grad():
            for key, value in loaded.items():
                params[key.split(".", 1)[1]].copy_(value)
    got = gather_adapter_tensors(chunks)
    if got is None:
        return {}
    want = peft_tensors(peft_model)
    return {"names": sorted(got) == sorted(want),
            "max_diff": max(float((got[n] - want[n]).abs().max()) for n in want)}


def fsdp_moe_lora_matches_megatron(path: str) -> dict:
    """The fsdp backend's peft LoRA (``add_peft_lora``) on an MoE model: its adapter names and
    shapes are our megatron model's (``gather_adapter_tensors``), its A matrices the same draws;
    with nonzero B, ``merged_hf_tensors`` (the rollout refill and ``actor_hf/``) equals peft's
    own ``merge_and_unload``, and our model loaded with its adapters gives peft's logits. Also:
    the names a rollout server expects in an adapter push are the model's."""
    from transformers import AutoModelForCausalLM

    import parallel_models as pm
    from parallel_models.lora import (LoraSettings, add_lora, gather_adapter_tensors,
                                      load_adapter_tensors)
    from parallel_models.rl.backends.fsdp.lora import add_peft_lora, merged_hf_tensors
    from tests.helpers.lora_checks import rel
    from tests.helpers.model_checks import _batch
    from tests.helpers.pipeline_checks import _microbatches_packed

    pm.init_parallel(tensor_parallel_size=1)
    settings = LoraSettings(rank=RANK, alpha=ALPHA)
    peft_model = add_peft_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                               settings)
    ours = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm",
                              rmpad=True).from_pretrained(path, dtype=torch.float32)
    add_lora(ours, settings)
    fresh_ours, fresh_peft = gather_adapter_tensors(ours), peft_tensors(peft_model)
    from parallel_models.lora.served import expected_adapter_names

    out = {"names": sorted(fresh_ours) == sorted(fresh_peft),
           "served_names": expected_adapter_names(ours, settings) == set(fresh_ours),
           "a_equal": all(torch.equal(fresh_ours[n], fresh_peft[n]) for n in fresh_peft
                          if "lora_A" in n)}
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    load_adapter_tensors(ours, peft_tensors(peft_model))
    merged = merged_hf_tensors(dict(peft_model.state_dict()), settings.scale)
    ids, mask = _batch(ours.config.vocab_size, "right", seed=2)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    mb = _microbatches_packed(ids, mask, 1)[0]
    with torch.no_grad():
        logits = ours(mb["input_ids"], mb["cu_seqlens"], full_vocab=True).logits
        want = peft_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        reference = peft_model.merge_and_unload().state_dict()
    out["merged_keys"] = sorted(merged) == sorted(reference)
    out["merged_diff"] = max(float((merged[k] - reference[k]).abs().max()) for k in reference)
    out["logits_rel"] = rel(logits, want[mask.bool()])
    return out
