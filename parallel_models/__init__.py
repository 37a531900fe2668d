"""parallel-models: tensor/sequence/pipeline-parallel Llama and Qwen2 on megatron-core."""

from parallel_models.config import ConfigError, ModelConfig
from parallel_models.distributed import (compute_device, destroy_parallel, get_parallel_settings,
                                         init_parallel)
from parallel_models.llama.checkpoint_utils import CheckpointError
from parallel_models.llama.modeling import CausalLMOutput, ParallelModel, ValueOutput
from parallel_models.models import (LlamaForCausalLM, LlamaForCausalLMRmPad, LlamaForValue,
                                    LlamaForValueRmPad, Qwen2ForCausalLM, Qwen2ForCausalLMRmPad,
                                    Qwen2ForValue, Qwen2ForValueRmPad)
from parallel_models.registry import (AutoModelForCausalLM, AutoModelForValue, get_model_class,
                                      supported_architectures)
from parallel_models.utils.padding import PackedBatch, pack_padded_batch, unpack_to_padded

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "ModelConfig", "CheckpointError", "init_parallel", "destroy_parallel",
    "get_parallel_settings", "compute_device", "ParallelModel", "CausalLMOutput", "ValueOutput",
    "LlamaForCausalLM", "LlamaForCausalLMRmPad", "LlamaForValue", "LlamaForValueRmPad",
    "Qwen2ForCausalLM", "Qwen2ForCausalLMRmPad", "Qwen2ForValue", "Qwen2ForValueRmPad",
    "AutoModelForCausalLM", "AutoModelForValue", "get_model_class", "supported_architectures",
    "PackedBatch", "pack_padded_batch", "unpack_to_padded",
]
