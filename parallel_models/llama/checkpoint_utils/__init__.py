"""Checkpoints, one file per concern (imports flow down this list; none imports the registry or
the model classes: what they need, a weight map or a config, is passed in):

- ``errors``          CheckpointError
- ``weight_rules``    one class per weight rule (pure shard / merge / megatron layout transforms)
- ``weight_map``      per-family mappings HF name <-> our parameter <-> megatron key + rule
- ``output_dir``      atomic output folders
- ``hf_format``       HF safetensors folders: slice reader, streaming shard writer, config.json
- ``torch_record``    the torch.save record format (decode; encode with CRC32s)
- ``direct_io``       O_DIRECT write-behind streams and page-cache-aware range reads
- ``dcp``             torch DCP metadata (allow-list unpickler) and the one-process DCP writer
- ``megatron_format`` megatron-core dist-checkpoint layout, mcore_config.json, GPTModel builder
- ``megatron_layout`` the Megatron-LM / Megatron-Bridge folder layouts (tracker, iter_*, args,
                      run_config.yaml) written and read
- ``megatron_hf_config`` the HF config a Megatron-LM args / Bridge run config describes
- ``mcore_reader``    a megatron-core dist checkpoint read through HF names
- ``loader``          one reader interface for every format, chosen from the folder; load_weights
- ``collective_save`` agreement between ranks, publication, the tied-embedding check
- ``saver``           save_pretrained (HF folder)
- ``mcore_saver``     save_mcore (megatron-core dist checkpoint)
"""

from parallel_models.llama.checkpoint_utils.errors import CheckpointError
from parallel_models.llama.checkpoint_utils.hf_format import (SafetensorsCheckpoint,
                                                             resolve_model_path)
from parallel_models.llama.checkpoint_utils.loader import (load_hf_weights, load_weights,
                                                          model_config_of, open_checkpoint)
from parallel_models.llama.checkpoint_utils.mcore_reader import McoreCheckpoint
from parallel_models.llama.checkpoint_utils.mcore_saver import save_mcore
from parallel_models.llama.checkpoint_utils.megatron_format import (build_gpt_model,
                                                                   is_mcore_checkpoint,
                                                                   mcore_config_dict)
from parallel_models.llama.checkpoint_utils.saver import save_pretrained
from parallel_models.llama.checkpoint_utils.weight_map import (LLAMA, QWEN2, WEIGHT_MAPS, WeightMap,
                                                              WeightMapping)

__all__ = ["CheckpointError", "SafetensorsCheckpoint", "resolve_model_path", "load_hf_weights",
           "load_weights", "model_config_of", "open_checkpoint", "McoreCheckpoint", "save_mcore",
           "build_gpt_model", "is_mcore_checkpoint", "mcore_config_dict", "save_pretrained", "LLAMA", "QWEN2",
           "WEIGHT_MAPS", "WeightMap", "WeightMapping"]
