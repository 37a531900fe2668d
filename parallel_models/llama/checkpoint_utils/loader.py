"""Load HF safetensors into a TP/PP-sharded model, each rank reading only its own slices."""

from __future__ import annotations

import json
import logging
import os

import torch
from megatron.core import parallel_state as mpu
from safetensors import SafetensorError, safe_open

from parallel_models.llama.checkpoint_utils.weight_map import shard_from_hf, weight_rules

logger = logging.getLogger(__name__)

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read as asked; the message names the file or tensor."""


def resolve_model_path(path: str) -> str:
    """A local folder as is; otherwise an HF hub id fetched (config + safetensors + tokenizer)."""
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise CheckpointError(f"{path}: expected a model folder, got a file")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "tokenizer*",
                                                       "*.model", "*.txt"])
    except Exception as err:  # offline, unknown repo, ...
        raise CheckpointError(f"{path}: not a local folder and could not be fetched from the "
                              f"Hugging Face Hub ({type(err).__name__}: {err})") from err


class SafetensorsCheckpoint:
    """Lazy, slice-level access to the tensors of an HF safetensors folder."""

    def __init__(self, folder: str):
        self.folder = folder
        index_path = os.path.join(folder, SAFE_INDEX)
        single = os.path.join(folder, SAFE_SINGLE)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{index_path}: not a valid safetensors index ({err})") from err
            self.files = {name: os.path.join(folder, fname) for name, fname in weight_map.items()}
            for fname in sorted(set(self.files.values())):
                if not os.path.isfile(fname):
                    raise CheckpointError(f"{fname}: shard named in {index_path} is missing")
        elif os.path.isfile(single):
            self.files = {name: single for name in self._open(single).keys()}
        else:
            found = sorted(os.listdir(folder))
            if any(f.endswith((".bin", ".pt", ".pth")) for f in found):
                raise CheckpointError(f"{folder}: only pickle weights (.bin/.pt) found; they are "
                                      "not loaded (unsafe). Convert them to safetensors.")
            raise CheckpointError(f"{folder}: no {SAFE_SINGLE} or {SAFE_INDEX}")
        self._handles: dict[str, object] = {}

    def _open(self, fname: str):
        handle = getattr(self, "_handles", {}).get(fname)
        if handle is None:
            try:
                handle = safe_open(fname, framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError) as err:
                raise CheckpointError(f"{fname}: cannot read safetensors file ({err})") from err
            if hasattr(self, "_handles"):
                self._handles[fname] = handle
        return handle

    def keys(self):
        return self.files.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _slice(self, name: str):
        if name not in self.files:
            raise CheckpointError(f"{self.folder}: tensor {name!r} not found in the checkpoint")
        fname = self.files[name]
        try:
            return self._open(fname).get_slice(name)
        except SafetensorError as err:
            raise CheckpointError(f"{fname}: cannot read tensor {name!r} ({err})") from err

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        from safetensors.torch import _getdtype  # maps "F32" -> torch.float32

        return _getdtype(self._slice(name).get_dtype())

    def __call__(self, name: str, dim: int | None, start: int | None, end: int | None):
        sl = self._slice(name)
        try:
            if dim is None:
                return sl[:]
            if dim == 0:
                return sl[start:end]
            if dim == 1:
                return sl[:, start:end]
        except SafetensorError as err:
            raise CheckpointError(f"{self.files[name]}: cannot read tensor {name!r} ({err})") from err
        raise ValueError(f"slicing along dim {dim} is not supported")


def open_checkpoint(folder: str, config=None):
    """The weights of ``folder``: HF safetensors, or a megatron-core dist checkpoint (``hf2mcore``
    / ``save_mcore`` output, or one megatron-core saved) seen through HF names."""
    from parallel_models.llama.checkpoint_utils.mcore import McoreCheckpoint, is_mcore_checkpoint

    if is_mcore_checkpoint(folder):
        ckpt = McoreCheckpoint(folder, config)
        ckpt.validate(ckpt.keys())
        return ckpt
    return SafetensorsCheckpoint(folder)


def load_hf_weights(model, folder: str, *, value_head_seed: int = 0, strict: bool = True) -> dict:
    """Fill ``model`` (this rank's shard) from the HF checkpoint in ``folder``.

    Returns a report ``{"missing": [...], "unexpected": [...], "initialized": [...]}``. Missing
    tensors raise (``strict``); unexpected ones are logged by name.
    """
    config = model.config
    ckpt = open_checkpoint(folder, config)
    tp = mpu.get_tensor_model_parallel_world_size()
    rank = mpu.get_tensor_model_parallel_rank()
    params = dict(model.named_parameters())
    local_layers = [layer.layer_id for layer in model.model.layers]
    used, missing, initialized = set(), [], []
    rules = weight_rules(config, model.head_kind, pre_process=model.pre_process,
                         post_process=model.post_process)
    jobs = []
    for rule in rules:
        if rule.per_layer:
            jobs += [(rule, rule.ours.format(i=li), tuple(n.format(i=gi) for n in rule.hf))
                     for li, gi in enumerate(local_layers)]
        else:
            jobs.append((rule, rule.ours, rule.hf))
    for rule, ours, hf_names in jobs:
        if ours not in params:
            raise CheckpointError(f"internal: weight map names {ours!r}, which the model lacks")
        absent = [n for n in hf_names if n not in ckpt]
        if absent:
            if ours == "value_head.weight":
                model.value_head.reset_parameters(config.initializer_range, seed=value_head_seed)
                initialized.append(ours)
                continue
            missing += absent
            continue
        shard = shard_from_hf(rule, hf_names, ckpt, config, tp, rank)
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
    unexpected = sorted(set(ckpt.keys()) - used - _owned_elsewhere(model, ckpt))
    if unexpected:
        logger.warning("%s: tensors not used by %s: %s", folder, type(model).__name__,
                       ", ".join(unexpected[:20]) + (" ..." if len(unexpected) > 20 else ""))
    return {"missing": sorted(missing), "unexpected": unexpected, "initialized": initialized}


def _owned_elsewhere(model, ckpt) -> set[str]:
    """HF tensors that belong to other pipeline stages or another head: not 'unexpected'."""
    config = model.config
    names = set()
    for rule in weight_rules(config, model.head_kind):
        if rule.per_layer:
            names.update(n.format(i=i) for n in rule.hf for i in range(config.num_layers))
        else:
            names.update(rule.hf)
    if model.head_kind == "value":
        names.add("lm_head.weight")  # a value model built from a causal LM drops its LM head
    return names
