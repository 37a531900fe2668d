"""parallel-models: tensor/sequence/pipeline-parallel Llama-family models (Llama, Qwen2, Qwen3, their
MoE versions, Mixtral, Gemma: parallel_models/llama/families/) on megatron-core.

The public names load on first use (PEP 562): ``import parallel_models`` and the light
submodules (``parallel_models.rl.config``, the console scripts' argument parsing) do not import
torch, megatron-core or transformers; ``parallel_models.AutoModelForCausalLM`` does.
"""

from __future__ import annotations

import importlib
import importlib.util

from parallel_models.errors import ConfigError


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("parallel-models")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


__version__ = _package_version()

# public name -> the submodule that defines it (imported on first access)
_LAZY = {
    "ModelConfig": "parallel_models.config",
    "CheckpointError": "parallel_models.llama.checkpoint_utils",
    "save_pretrained": "parallel_models.llama.checkpoint_utils",
    "save_mcore": "parallel_models.llama.checkpoint_utils",
    "init_parallel": "parallel_models.distributed",
    "destroy_parallel": "parallel_models.distributed",
    "get_parallel_settings": "parallel_models.distributed",
    "compute_device": "parallel_models.distributed",
    "training_layout": "parallel_models.distributed",
    "ParallelLayout": "parallel_models.parallel_layout",
    "ParallelModel": "parallel_models.llama.modeling",
    "CausalLMOutput": "parallel_models.llama.modeling",
    "ValueOutput": "parallel_models.llama.modeling",
    "build_pipeline_chunks": "parallel_models.pipeline",
    "format_pipeline_layout": "parallel_models.pipeline",
    "forward_backward": "parallel_models.pipeline",
    "forward_only": "parallel_models.pipeline",
    "pipeline_layout": "parallel_models.pipeline",
    "AutoModelForCausalLM": "parallel_models.registry",
    "AutoModelForValue": "parallel_models.registry",
    "get_model_class": "parallel_models.registry",
    "supported_architectures": "parallel_models.registry",
    "PackedBatch": "parallel_models.utils.padding",
    "pack_padded_batch": "parallel_models.utils.padding",
    "unpack_to_padded": "parallel_models.utils.padding",
}
_MODELS = "parallel_models.models"  # the {Arch}For{Head}[RmPad][PP] classes (its __all__)


def _model_names() -> list[str]:
    return list(importlib.import_module(_MODELS).__all__)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name == "__all__":
        value = ["ConfigError", *_LAZY, *_model_names()]
    elif "For" in name and name in _model_names():
        value = getattr(importlib.import_module(_MODELS), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # e.g. ``pm.registry``
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"ConfigError", *_LAZY} | set(_model_names()))
