"""LoRA on the megatron-backend models: settings, TP-aware adapters, PEFT adapter folders."""

from parallel_models.lora.apply import (adapters_disabled, adapters_merged, add_lora, has_lora,
                                        lora_modules, trainable_parameter_count)
from parallel_models.lora.config import LoraSettings
from parallel_models.lora.peft_io import (gather_adapter_tensors, load_adapter,
                                          load_adapter_tensors, save_adapter)

__all__ = ["LoraSettings", "add_lora", "adapters_disabled", "adapters_merged", "has_lora",
           "lora_modules", "trainable_parameter_count", "save_adapter", "load_adapter",
           "load_adapter_tensors", "gather_adapter_tensors"]
