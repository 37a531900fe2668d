"""LoRA on the fsdp backend through ``peft`` itself (``actor.lora.*``, ``critic.lora.*``).

- :func:`add_peft_lora`: ``peft.get_peft_model`` on the transformers causal LM *before*
  ``fully_shard``. FSDP2 shards each parameter on its own (DTensor), so a decoder layer's unit
  holds its frozen base weights and its trainable adapters together: the base is all-gathered
  for the forward as before, only the adapters get (reduce-scattered) gradients and optimizer
  states. (FSDP1 needed ``use_orig_params=True`` for such mixed units; FSDP2 has no flat
  parameters.) The A matrices are redrawn with the megatron backend's per-projection seeds
  (``parallel_models.lora.layers.init_full_a``), so both backends start from the same adapters.
- The reference policy is the actor with its adapters off: peft's ``disable_adapter()``
  context (``rl/roles/lora_reference.py``).
- :func:`merged_hf_tensors`: a unit's full tensors in peft's names -> the merged weights
  (``W + alpha / r * B @ A``) in the base model's HF names, for the rollout refill and the
  merged ``actor_hf/`` export.
- :func:`export_adapter`: ``actor_lora/``, written by peft's own ``save_pretrained`` from the
  gathered full state dict.
- The critic (:func:`add_peft_value_lora`): peft's ``SEQ_CLS`` LoRA on the ``ValueModel``'s
  sequence-classification model (injected in place, so ``ValueModel.model`` runs it), the
  ``score`` head trained whole (peft's ``modules_to_save`` copy), as the megatron critic's LoRA;
  :func:`export_value_lora` writes ``critic_lora/`` (peft's folder, with
  ``base_model.model.score.weight``) and the merged ``critic_hf/``.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from parallel_models.errors import ConfigError
from parallel_models.lora.config import LoraSettings

PEFT_PREFIX = "base_model.model."


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def _init_like_megatron(peft_model, settings: LoraSettings) -> None:
    """Every ``lora_A`` drawn as the megatron backend draws it (same seed per layer and
    projection; an MoE layer's expert adapters, peft's ``ParamWrapper``, at their ``[E * r,
    in]`` size with the experts' seed); B stays zero (peft's default)."""
    from parallel_models.lora.apply import _seed, seed_experts
    from parallel_models.lora.layers import init_full_a

    with torch.no_grad():
        for name, module in peft_model.named_modules():
            lora_a = getattr(module, "lora_A", None)
            if lora_a is None or "default" not in lora_a:
                continue
            parts = name.split(".")
            layer_id = int(parts[parts.index("layers") + 1])
            weight = lora_a["default"].weight
            proj = getattr(module, "parameter_name", None)  # a ParamWrapper's parameter
            seed = (seed_experts(settings, layer_id, proj) if proj is not None
                    else _seed(settings, layer_id, parts[-1]))
            weight.copy_(init_full_a(weight.shape[0], weight.shape[1], seed))


def _lora_config(hf_model, settings: LoraSettings, task_type: str):
    """peft's ``LoraConfig`` of ``settings`` on ``hf_model``: on an MoE model the megatron
    backend's adapters (the experts' ``target_parameters``; ``lora/apply.py``), which its
    ``actor_lora/`` export names."""
    from peft import LoraConfig

    from parallel_models.config import ModelConfig
    from parallel_models.lora.apply import check_moe_targets, peft_adapter_config

    model_config = ModelConfig.from_hf(hf_model.config)
    fields = {"target_modules": list(settings.target_modules)}
    if model_config.is_moe:
        check_moe_targets(model_config, settings)
        cfg = peft_adapter_config(settings, model_config)
        fields = {k: cfg[k] for k in ("target_modules", "target_parameters") if k in cfg}
    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      bias="none", task_type=task_type, **fields)


def add_peft_lora(hf_model, settings: LoraSettings):
    """``hf_model`` (a transformers causal LM, not yet sharded) under peft LoRA with
    ``settings``; the base is frozen. Returns the ``PeftModelForCausalLM``."""
    from peft import get_peft_model

    _check_targets(hf_model, settings, "actor.lora.target_modules")
    config = _lora_config(hf_model, settings, "CAUSAL_LM")
    peft_model = get_peft_model(hf_model, config)
    _init_like_megatron(peft_model, settings)
    peft_model.lora_settings = settings
    return peft_model


def _check_targets(hf_model, settings: LoraSettings, key: str) -> None:
    known = {n for n, _ in hf_model.named_modules()}
    if any(n.endswith(".experts") for n in known):  # gate/up/down: the fused experts' names
        known |= {f"x.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    missing = [t for t in settings.target_modules if not any(n.endswith("." + t) for n in known)]
    if missing:
        raise ConfigError(f"{key}: {type(hf_model).__name__} has no {missing} module")


def add_peft_value_lora(value_model, settings: LoraSettings):
    """peft's ``SEQ_CLS`` LoRA on ``value_model`` (an fsdp ``ValueModel``, not yet sharded):
    adapters on ``settings``' targets, the base frozen, the ``score`` head trainable whole
    (``modules_to_save``). Returns ``value_model`` (its ``.model`` now holds the adapters; the
    ``PeftModel`` is ``.peft_model``, not a submodule)."""
    from peft import get_peft_model

    _check_targets(value_model.model, settings, "critic.lora.target_modules")
    config = _lora_config(value_model.model, settings, "SEQ_CLS")
    peft_model = get_peft_model(value_model.model, config)  # injects into it in place
    _init_like_megatron(peft_model, settings)
    object.__setattr__(value_model, "peft_model", peft_model)
    value_model.lora_settings = settings
    return value_model


def is_lora_value_model(model) -> bool:
    return getattr(model, "peft_model", None) is not None


def export_value_lora(value_model, output_dir: str) -> None:
    """``critic_lora/`` (peft's SEQ_CLS folder: the adapters and ``score``) and the merged
    ``critic_hf/`` of a LoRA ``ValueModel``; collective."""
    sd = full_state_dict(value_model)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        peft_sd = {PEFT_PREFIX + k[len("model."):]: v for k, v in sd.items()}
        peft_model = value_model.peft_model
        export_adapter(peft_model, os.path.join(output_dir, "critic_lora"),
                       {k: v for k, v in peft_sd.items() if ".lora_" in k or ".modules_to_save." in k},
                       keep=lambda k: True)
        folder = os.path.join(output_dir, "critic_hf")
        tmp = folder.rstrip("/") + ".tmp-export"
        shutil.rmtree(tmp, ignore_errors=True)
        merged = merged_hf_tensors(peft_sd, value_model.lora_settings.scale)
        peft_model.get_base_model().save_pretrained(tmp, state_dict=merged)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    if dist.is_initialized():
        dist.barrier()


def trainable_count(model) -> int:
    """The full-size count of the trainable parameters (sharded or not)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def merged_hf_tensors(tensors: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Full tensors in peft's names (``base_model.model.X.base_layer.weight``,
    ``X.lora_A.default.weight``, ...) -> the base model's HF names, the adapted weights merged
    (``W + scale * B @ A``); adapter tensors are dropped, a ``modules_to_save`` module (the
    critic's ``score``) is its trained copy."""
    out = {}
    for name, t in tensors.items():
        if ".lora_A." in name or ".lora_B." in name or ".original_module." in name:
            continue  # (a trained modules_to_save copy replaces its original)
        hf_name = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
        hf_name = hf_name.replace(".modules_to_save.default.", ".")
        if ".base_layer." in name:
            stem = name.split(".base_layer.")[0]
            while ".base_layer." in hf_name:  # (nested ParamWrappers: base_layer.base_layer)
                hf_name = hf_name.replace(".base_layer.", ".")
            if name.endswith(".base_layer.weight"):
                a = tensors[f"{stem}.lora_A.default.weight"]
                b = tensors[f"{stem}.lora_B.default.weight"]
                t = t + (b.to(torch.float32) @ a.to(torch.float32) * scale).to(t.dtype)
            elif t.dim() == 3:  # fused experts [E, out, in] under peft's ParamWrapper(s)
                t = t + _expert_delta(tensors, stem, t, scale)
        out[hf_name] = t
    return out


def _expert_delta(tensors: dict, stem: str, weight: torch.Tensor, scale: float) -> torch.Tensor:
    """peft's ``ParamWrapper`` delta of one fused expert parameter ``weight [E, out, in]``:
    ``scale * B_e @ A_e`` per expert (``lora/experts.py``), from the wrapper (nested ones sit
    at ``stem`` and ``stem.base_layer``) whose A / B fit its shape; zeros if none adapts it."""
    experts, out_features, in_features = weight.shape
    for wrapper in (f"{stem}.base_layer", stem):
        a = tensors.get(f"{wrapper}.lora_A.default.weight")
        b = tensors.get(f"{wrapper}.lora_B.default.weight")
        if a is None or b is None or a.shape[1] != in_features or b.shape[0] != out_features:
            continue
        a = a.to(torch.float32).reshape(experts, -1, in_features)
        b = b.to(torch.float32).reshape(out_features, -1, experts)
        return (torch.einsum("o r e, e r i -> e o i", b, a) * scale).to(weight.dtype)
    return torch.zeros_like(weight)


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The full (gathered) state dict of a sharded model on rank 0, on the host; collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def export_adapter(peft_model, folder: str, sd: dict, keep=lambda k: ".lora_" in k) -> None:
    """``folder`` as a PEFT adapter folder (peft's ``save_pretrained`` of the gathered
    ``sd``'s tensors that ``keep`` names), written on rank 0."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    tmp = folder.rstrip("/") + ".tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    lora = {k: v for k, v in sd.items() if keep(k)}
    peft_model.save_pretrained(tmp, state_dict=lora)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def export_merged_hf(peft_model, folder: str, sd: dict, tokenizer=None) -> None:
    """``folder`` as the base model's HF folder with the merged weights, on rank 0."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    tmp = folder.rstrip("/") + ".tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    base = peft_model.get_base_model()
    base.save_pretrained(tmp, state_dict=merged_hf_tensors(sd, peft_model.lora_settings.scale))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def export_lora(peft_model, output_dir: str, tokenizer=None) -> None:
    """``actor_lora/`` (PEFT folder) and the merged ``actor_hf/``; collective."""
    sd = full_state_dict(peft_model)
    export_adapter(peft_model, os.path.join(output_dir, "actor_lora"), sd)
    export_merged_hf(peft_model, os.path.join(output_dir, "actor_hf"), sd, tokenizer)
    if dist.is_initialized():
        dist.barrier()
