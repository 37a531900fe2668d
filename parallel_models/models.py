"""The public variant classes, one per family x head x input layout x pipeline stage, e.g.
``LlamaForCausalLM``, ``Qwen3ForValueRmPad``, ``Qwen3MoeForCausalLMRmPadPP`` (made by the
registry from the families' weight maps, so a new family needs no edit here)."""

from parallel_models.registry import all_classes

globals().update(all_classes())

__all__ = sorted(all_classes())
