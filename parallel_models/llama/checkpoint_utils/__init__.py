"""HF <-> sharded weights: the declarative weight map, the streaming loader (and saver)."""

from parallel_models.llama.checkpoint_utils.loader import (CheckpointError, SafetensorsCheckpoint,
                                                          load_hf_weights, resolve_model_path)
from parallel_models.llama.checkpoint_utils.weight_map import WeightRule, shard_from_hf, weight_rules

__all__ = ["CheckpointError", "SafetensorsCheckpoint", "load_hf_weights", "resolve_model_path",
           "WeightRule", "shard_from_hf", "weight_rules"]
