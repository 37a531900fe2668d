"""Checkpoints: the declarative weight map, the streaming HF loader, the HF saver, and the
megatron-core dist-checkpoint reader/writer (``hf2mcore`` / ``mcore2hf`` / ``save_mcore``)."""

from parallel_models.llama.checkpoint_utils.loader import (CheckpointError, SafetensorsCheckpoint,
                                                          load_hf_weights, open_checkpoint,
                                                          resolve_model_path)
from parallel_models.llama.checkpoint_utils.mcore import (McoreCheckpoint, build_gpt_model,
                                                         is_mcore_checkpoint, mcore_config_dict,
                                                         save_mcore)
from parallel_models.llama.checkpoint_utils.saver import save_pretrained
from parallel_models.llama.checkpoint_utils.weight_map import (WeightRule, merge_to_hf,
                                                              shard_from_hf, weight_rules)

__all__ = ["CheckpointError", "SafetensorsCheckpoint", "load_hf_weights", "open_checkpoint",
           "resolve_model_path", "McoreCheckpoint", "build_gpt_model", "is_mcore_checkpoint",
           "mcore_config_dict", "save_mcore", "save_pretrained", "WeightRule", "merge_to_hf",
           "shard_from_hf", "weight_rules"]
