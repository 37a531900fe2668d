"""parallel-models: tensor/sequence/pipeline-parallel Llama and Qwen2 on megatron-core."""

from parallel_models.config import ConfigError, ModelConfig
from parallel_models.distributed import (compute_device, destroy_parallel, get_parallel_settings,
                                         init_parallel)
from parallel_models.llama.checkpoint_utils import CheckpointError, save_mcore, save_pretrained
from parallel_models.llama.modeling import CausalLMOutput, ParallelModel, ValueOutput
from parallel_models.models import *  # noqa: F401,F403  (the {Arch}For{Head}[RmPad][PP] classes)
from parallel_models.models import __all__ as _model_names
from parallel_models.pipeline import (build_pipeline_chunks, format_pipeline_layout, forward_backward,
                                      forward_only, pipeline_layout)
from parallel_models.registry import (AutoModelForCausalLM, AutoModelForValue, get_model_class,
                                      supported_architectures)
from parallel_models.utils.padding import PackedBatch, pack_padded_batch, unpack_to_padded

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "ModelConfig", "CheckpointError", "save_pretrained", "save_mcore", "init_parallel", "destroy_parallel",
    "get_parallel_settings", "compute_device", "ParallelModel", "CausalLMOutput", "ValueOutput",
    *_model_names, "build_pipeline_chunks", "format_pipeline_layout", "forward_backward",
    "forward_only", "pipeline_layout",
    "AutoModelForCausalLM", "AutoModelForValue", "get_model_class", "supported_architectures",
    "PackedBatch", "pack_padded_batch", "unpack_to_padded",
]
