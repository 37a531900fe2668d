"""Weights of the fsdp actor into the rollout engine's model, one FSDP unit at a time.

For a family in our registry the rollout engine generates with our parallel CausalLM (KV cache,
its decode kernels). Before each rollout :func:`sync_rollout_model` copies the FSDP actor into
it: for each decoder layer (an FSDP unit) in turn, then the root's own parameters (embeddings,
final norm, LM head), every rank all-gathers that unit's full tensors (``DTensor.full_tensor``),
and the one weight map (``checkpoint_utils``' loader rules, fed by an in-memory reader of HF
names) copies them into this rank's part of the rollout model; transformers 5's in-memory names
are first turned into the checkpoint's (``revert_weight_conversion``, as its ``save_pretrained``
does: an MoE layer's fused experts become one tensor per expert). No rank holds more than one
unit's full tensors beyond the rollout model itself. A peft LoRA actor's unit is merged first
(``W + alpha / r * B @ A`` under the base model's names: ``fsdp/lora.py``).
"""

from __future__ import annotations

import torch

from parallel_models.rl.backends.fsdp.models import decoder_layers


def _units(model) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """The parameters by FSDP unit (each decoder layer, then the rest), with their HF names."""
    named = list(model.named_parameters())
    units, seen = [], set()
    for layer in decoder_layers(model):
        ids = {id(p) for p in layer.parameters()}
        units.append([(n, p) for n, p in named if id(p) in ids])
        seen |= ids
    units.append([(n, p) for n, p in named if id(p) not in seen])
    return units


@torch.no_grad()
def sync_rollout_model(fsdp_model, rollout_model) -> int:
    """Copy ``fsdp_model`` (a sharded HF causal LM) into ``rollout_model`` (our CausalLM);
    collective. Returns the number of tensors copied."""
    from parallel_models.llama.checkpoint_utils.loader import load_weights
    from parallel_models.inference import TensorReader

    from parallel_models.rl.backends.fsdp.lora import is_peft_model, merged_hf_tensors

    from transformers.core_model_loading import revert_weight_conversion

    scale = fsdp_model.lora_settings.scale if is_peft_model(fsdp_model) else None
    hf_model = fsdp_model.get_base_model() if scale is not None else fsdp_model
    copied = 0
    for unit in _units(fsdp_model):
        tensors = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                   for name, p in unit}
        if scale is not None:
            tensors = merged_hf_tensors(tensors, scale)
        # transformers 5's in-memory names -> the checkpoint's, which the weight map reads
        # (an MoE layer's fused experts [E, 2I, H] -> one tensor per expert, as on disk)
        tensors = revert_weight_conversion(hf_model, tensors)
        load_weights(rollout_model, TensorReader(tensors), rollout_model.weight_map,
                     strict=False)
        copied += len(tensors)
        del tensors
    return copied
