"""The public variant classes, one per family x head x input layout (made by the registry)."""

from parallel_models.registry import model_class

LlamaForCausalLM = model_class("LlamaForCausalLM")
LlamaForCausalLMRmPad = model_class("LlamaForCausalLMRmPad")
LlamaForValue = model_class("LlamaForValue")
LlamaForValueRmPad = model_class("LlamaForValueRmPad")
Qwen2ForCausalLM = model_class("Qwen2ForCausalLM")
Qwen2ForCausalLMRmPad = model_class("Qwen2ForCausalLMRmPad")
Qwen2ForValue = model_class("Qwen2ForValue")
Qwen2ForValueRmPad = model_class("Qwen2ForValueRmPad")

__all__ = [name for name in dir() if "For" in name]
