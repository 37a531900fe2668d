"""The public variant classes, one per family x head x input layout x pipeline (made by the
registry)."""

from parallel_models.registry import model_class

LlamaForCausalLM = model_class("LlamaForCausalLM")
LlamaForCausalLMPP = model_class("LlamaForCausalLMPP")
LlamaForCausalLMRmPad = model_class("LlamaForCausalLMRmPad")
LlamaForCausalLMRmPadPP = model_class("LlamaForCausalLMRmPadPP")
LlamaForValue = model_class("LlamaForValue")
LlamaForValuePP = model_class("LlamaForValuePP")
LlamaForValueRmPad = model_class("LlamaForValueRmPad")
LlamaForValueRmPadPP = model_class("LlamaForValueRmPadPP")
Qwen2ForCausalLM = model_class("Qwen2ForCausalLM")
Qwen2ForCausalLMPP = model_class("Qwen2ForCausalLMPP")
Qwen2ForCausalLMRmPad = model_class("Qwen2ForCausalLMRmPad")
Qwen2ForCausalLMRmPadPP = model_class("Qwen2ForCausalLMRmPadPP")
Qwen2ForValue = model_class("Qwen2ForValue")
Qwen2ForValuePP = model_class("Qwen2ForValuePP")
Qwen2ForValueRmPad = model_class("Qwen2ForValueRmPad")
Qwen2ForValueRmPadPP = model_class("Qwen2ForValueRmPadPP")

__all__ = [name for name in dir() if "For" in name]
