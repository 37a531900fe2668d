"""Load weights into a TP/PP/EP-sharded model, each rank reading only its own slices (and, for
MoE layers, only its own experts).

Every checkpoint format is read through one small interface, :class:`WeightReader`: HF tensors by
name, sliced along a dim. :func:`open_checkpoint` picks the reader once, from the folder:
``hf_format.SafetensorsCheckpoint`` for an HF folder, ``mcore_reader.McoreCheckpoint`` for a
megatron-core dist checkpoint (``hf2mcore`` / ``save_mcore`` output, or one megatron-core saved).
:func:`load_weights` then fills the model through the weight map's rules, whatever the format.
"""

from __future__ import annotations

import logging
from typing import Iterable, Protocol

import torch

from parallel_models.llama.checkpoint_utils.errors import CheckpointError
from parallel_models.llama.checkpoint_utils.hf_format import (SafetensorsCheckpoint,
                                                             resolve_model_path)
from parallel_models.config import ModelConfig
from parallel_models.llama.checkpoint_utils.mcore_reader import McoreCheckpoint, config_of_mcore_dir
from parallel_models.llama.checkpoint_utils.megatron_format import (is_mcore_checkpoint,
                                                                   resolve_mcore_dir)
from parallel_models.llama.checkpoint_utils.weight_map import WeightMap

logger = logging.getLogger(__name__)

__all__ = ["WeightReader", "open_checkpoint", "load_weights", "load_hf_weights",
           "resolve_model_path", "model_config_of", "CheckpointError"]


class WeightReader(Protocol):
    """HF-named tensors of a checkpoint, read slice by slice (what the weight rules read)."""

    folder: str

    def keys(self) -> Iterable[str]: ...

    def __contains__(self, name: str) -> bool: ...

    def shape(self, name: str) -> list[int]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def __call__(self, name: str, dim: int | None, start: int | None, end: int | None
                 ) -> torch.Tensor: ...


def model_config_of(folder: str) -> ModelConfig:
    """The model config of a checkpoint folder of any format: an HF folder's config.json; for a
    megatron-core dist checkpoint (any layout) its config.json, else the one its Megatron-Bridge
    run config or Megatron-LM args describe."""
    if is_mcore_checkpoint(folder):
        return config_of_mcore_dir(resolve_mcore_dir(folder))
    return ModelConfig.from_hf(folder)


def open_checkpoint(folder: str, weight_map: WeightMap, config=None) -> WeightReader:
    """The reader for ``folder``: a megatron-core dist checkpoint (validated against ``config``
    up front) or an HF safetensors folder."""
    if is_mcore_checkpoint(folder):
        ckpt = McoreCheckpoint(folder, weight_map, config)
        ckpt.validate(ckpt.keys())
        return ckpt
    return SafetensorsCheckpoint(folder)


def load_weights(model, ckpt: WeightReader, weight_map: WeightMap, *, value_head_seed: int = 0,
                 strict: bool = True) -> dict:
    """Fill ``model`` (this rank's shard) from ``ckpt`` through ``weight_map``.

    Returns a report ``{"missing": [...], "unexpected": [...], "initialized": [...]}``. Missing
    tensors raise (``strict``); unexpected ones are logged by name; an optional one that is
    absent (the value head) is initialized fresh with ``value_head_seed``.
    """
    config = model.config
    folder = ckpt.folder
    layout = model.parallel_layout  # the layout the model was built in: its shards
    tp = layout.tensor_parallel_size
    rank = layout.tensor_parallel_rank
    params = dict(model.named_parameters())
    local_layers = [layer.layer_id for layer in model.model.layers]
    used, missing, initialized = set(), [], []
    jobs = []
    for mapping in weight_map.mappings(config, model.head_kind, pre_process=model.pre_process,
                                       post_process=model.post_process):
        if mapping.per_layer:
            local_expert = None
            if mapping.expert is not None:  # a routed expert: only this EP rank's experts
                local_expert = mapping.local_expert(
                    config, layout.expert_parallel_size, layout.expert_parallel_rank)
                if local_expert is None:
                    continue
            jobs += [(mapping, mapping.ours_name(li, local_expert), mapping.hf_names(gi))
                     for li, gi in enumerate(local_layers) if mapping.applies_to(config, gi)]
        else:
            jobs.append((mapping, mapping.ours, mapping.hf))
    for mapping, ours, hf_names in jobs:
        if ours not in params:
            raise CheckpointError(f"internal: weight map names {ours!r}, which the model lacks")
        absent = [n for n in hf_names if n not in ckpt]
        if absent:
            if mapping.optional:
                model.value_head.reset_parameters(config.initializer_range, seed=value_head_seed)
                initialized.append(ours)
            else:
                missing += absent
            continue
        if mapping.expert is not None:  # experts are split over the expert-TP group
            shard = mapping.rule.shard(ckpt, hf_names, config,
                                       layout.expert_tensor_parallel_size,
                                       layout.expert_tensor_parallel_rank)
        else:
            shard = mapping.rule.shard(ckpt, hf_names, config, tp, rank)
        param = params[ours]
        if tuple(shard.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{folder}: {', '.join(hf_names)} gives shape {tuple(shard.shape)} for {ours}, "
                f"expected {tuple(param.shape)} (config.json does not match the weights?)")
        with torch.no_grad():
            param.copy_(shard)
        used.update(hf_names)
    if missing and strict:
        raise CheckpointError(f"{folder}: missing tensors: {', '.join(sorted(missing))}")
    unexpected = sorted(set(ckpt.keys()) - used - _owned_elsewhere(model, weight_map))
    if unexpected:
        logger.warning("%s: tensors not used by %s: %s", folder, type(model).__name__,
                       ", ".join(unexpected[:20]) + (" ..." if len(unexpected) > 20 else ""))
    return {"missing": sorted(missing), "unexpected": unexpected, "initialized": initialized}


def load_hf_weights(model, folder: str, *, value_head_seed: int = 0, strict: bool = True,
                    weight_map: WeightMap | None = None) -> dict:
    """Open ``folder`` (any format) and fill ``model`` from it; ``weight_map``: default the one
    the model carries. See :func:`load_weights`."""
    weight_map = weight_map if weight_map is not None else getattr(model, "weight_map", None)
    if weight_map is None:
        raise CheckpointError(f"{type(model).__name__} carries no weight map; pass weight_map=")
    ckpt = open_checkpoint(folder, weight_map, model.config)
    return load_weights(model, ckpt, weight_map, value_head_seed=value_head_seed, strict=strict)


def _owned_elsewhere(model, weight_map: WeightMap) -> set[str]:
    """HF tensors that belong to other pipeline stages or another head: not 'unexpected'."""
    config = model.config
    names = set()
    for mapping in weight_map.mappings(config, model.head_kind):
        for layer in (range(config.num_layers) if mapping.per_layer else [None]):
            if mapping.applies_to(config, layer):
                names.update(mapping.hf_names(layer))
    if model.head_kind == "value":
        names.add("lm_head.weight")  # a value model built from a causal LM drops its LM head
    return names
