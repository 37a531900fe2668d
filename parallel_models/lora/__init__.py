"""LoRA on the megatron-backend models: settings (``config``), TP-aware adapters on our parallel
linears (``layers``) and on MoE layers' routed experts (``experts``: PEFT's target_parameters),
adding them to a built model (``apply``), PEFT adapter folders
(``peft_io``), the adapters in trainer checkpoints (``checkpoint``), the merged weight sync
(``training``) and adapter-only pushes to the rollout server (``server_push``, the server's side
``served``). Names are imported on first use, so the PPO config can read the settings
without importing torch."""

import importlib

_EXPORTS = {
    "LoraSettings": "config",
    "add_lora": "apply", "adapters_disabled": "apply", "adapters_merged": "apply",
    "has_lora": "apply", "lora_modules": "apply", "trainable_parameter_count": "apply",
    "save_adapter": "peft_io", "load_adapter": "peft_io", "load_adapter_tensors": "peft_io",
    "gather_adapter_tensors": "peft_io",
    "enable_lora": "training", "adapter_parameter_count": "training",
    "MergedWeightSync": "training",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'parallel_models.lora' has no attribute {name!r}")
    return getattr(importlib.import_module(f"parallel_models.lora.{_EXPORTS[name]}"), name)
