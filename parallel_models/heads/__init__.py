"""Model heads: the vocab-parallel LM head and the value head (critic / reward)."""

from parallel_models.heads.lm_head import ParallelLMHead
from parallel_models.heads.value_head import ValueHead

__all__ = ["ParallelLMHead", "ValueHead"]
