"""One module per model family (what differs from Llama, declared once) and their registry.

Importing this package registers every family (Llama, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE,
Mixtral, Gemma). A new family is one more module here (a ``@register_family`` ``Family``
subclass) plus its name in the import below; nothing outside this package names a family.
"""

from parallel_models.llama.families import (gemma, llama, mixtral, qwen2, qwen2_moe,  # noqa: F401
                                            qwen3, qwen3_moe)
from parallel_models.llama.families.registry import (Family, all_families, family_from_megatron,
                                                     family_named, family_of_model_type,
                                                     register_family)

__all__ = ["Family", "all_families", "family_from_megatron", "family_named",
           "family_of_model_type", "register_family"]
