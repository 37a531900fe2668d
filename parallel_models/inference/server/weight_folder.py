"""``POST /update_weights``: does a weights folder fit the served model? Checked before loading.

The loader fills the model's tensors by name, so a folder of another shape of model can load
"successfully": a 3-layer model into a 2-layer one (its last layer ignored), or 8 heads of 8
instead of 4 heads of 16 (the same tensor shapes, another model). So, on rank 0 and before the
update is queued:

- the folder's ``config.json`` (when it has one), read as the served model's was
  (:meth:`~parallel_models.config.ModelConfig.from_hf`), must agree on every field that shapes
  the computation (layers, widths, heads, head_dim, KV heads, rope, vocab, norm eps, biases,
  tying, MoE fields); a mismatch names the field and both values;
- an HF safetensors folder must hold exactly the model's tensors with their shapes (headers
  only, no data read): a missing one, a wrong shape or a tensor the model does not have is
  refused (``weight_stream.check_against_model``, the check of pushed weights).

A megatron-core checkpoint's tensors are checked against the config by its reader as it loads.
"""

from __future__ import annotations

import dataclasses
import os

import torch

# ModelConfig fields that do not change what the model computes
_NOT_COMPARED = {"architecture", "initializer_range", "torch_dtype", "hf_config",
                 "router_aux_loss_coef"}


class WeightFolderError(ValueError):
    """The folder does not fit the served model (the message names what differs)."""


def config_mismatches(theirs, ours) -> list[str]:
    """``field: folder X, served Y`` for every compared field of two ``ModelConfig``s."""
    out = []
    for field in dataclasses.fields(ours):
        if field.name in _NOT_COMPARED:
            continue
        a, b = getattr(theirs, field.name), getattr(ours, field.name)
        if a != b:
            out.append(f"{field.name}: folder {a!r}, served {b!r}")
    return out


def check_weight_folder(path: str, model) -> None:
    """:class:`WeightFolderError` unless the folder ``path`` fits ``model`` (module doc)."""
    from parallel_models.config import ModelConfig
    from parallel_models.inference.server.weight_stream import (WeightStreamError,
                                                                 check_against_model)
    from parallel_models.llama.checkpoint_utils.hf_format import SafetensorsCheckpoint
    from parallel_models.llama.checkpoint_utils.errors import CheckpointError
    from parallel_models.llama.checkpoint_utils.megatron_format import is_mcore_checkpoint

    from parallel_models.llama.checkpoint_utils.checksums import (ChecksumMismatch,
                                                                   verify_manifest)

    try:  # a checksums.json (hf2mcore / mcore2hf / the trainer write one): damaged data refused
        verify_manifest(path)
    except ChecksumMismatch as exc:
        raise WeightFolderError(str(exc)) from None
    if os.path.isfile(os.path.join(path, "config.json")):
        try:
            theirs = ModelConfig.from_hf(path)
        except Exception as exc:  # noqa: BLE001 - any config that does not read is refused
            raise WeightFolderError(f"config.json does not read as a model config: "
                                    f"{type(exc).__name__}: {exc}") from None
        problems = config_mismatches(theirs, model.config)
        if problems:
            raise WeightFolderError("its config.json is another model than the served one: "
                                    + "; ".join(problems))
    if is_mcore_checkpoint(path):
        return
    try:
        ckpt = SafetensorsCheckpoint(path)
        metas = {name: torch.empty(ckpt.shape(name), dtype=ckpt.dtype(name), device="meta")
                 for name in ckpt.keys()}
    except (CheckpointError, OSError, ValueError) as exc:
        raise WeightFolderError(str(exc)) from None
    if model.config.tie_word_embeddings:
        metas.pop("lm_head.weight", None)  # a tied head some writers save anyway (not loaded)
    try:
        check_against_model(metas, model)
    except WeightStreamError as exc:
        raise WeightFolderError(str(exc).replace("pushed weights", "its tensors")) from None


__all__ = ["WeightFolderError", "check_weight_folder", "config_mismatches"]
