"""Checkpoints and HF export of the fsdp backend's trainable roles.

- :func:`save_roles` writes every role's sharded model and AdamW states
  (``torch.distributed.checkpoint.state_dict.get_state_dict``: DTensor shards, parameter-name
  keys) as one ``torch.distributed.checkpoint`` folder, keys prefixed by the role name; each rank
  writes its own shards. The rest of a trainer checkpoint (JSON state, RNG, atomic rename) is
  ``rl/checkpointing.py``'s, as for the megatron backend.
- Resume reads into *copies* (:func:`state_for_loading` then :func:`load_roles`) and only then
  replaces the weights and optimizer states (:func:`apply_loaded`), so a failed load leaves the
  roles as they were (:func:`forget` drops the zero optimizer states declaring them created).
- :func:`export_hf`: the full state dict gathered to rank 0 (CPU), ``save_pretrained`` there
  into a temporary sibling, renamed into place.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)

from parallel_models.rl.backends.fsdp.models import ValueModel


def model_shape(model) -> dict:
    """The shape of an HF model the checkpoint records (a resume must match it)."""
    c = model.config
    return {"head_kind": "value" if isinstance(model, ValueModel) else "causal_lm",
            "architecture": (getattr(c, "architectures", None) or [type(model).__name__])[0],
            "num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size}


def _options(model) -> StateDictOptions | None:
    """A peft LoRA model: the trainable parameters only (the frozen base comes from
    ``model.path`` again on resume)."""
    if any(not p.requires_grad for p in model.parameters()):
        return StateDictOptions(ignore_frozen_params=True, strict=False)
    return None


def _state(role) -> dict:
    msd, osd = get_state_dict(role.model, role.state.optimizer, options=_options(role.model))
    return {"model": msd, "optimizer": osd}


def save_roles(folder: str, roles: dict) -> None:
    """``roles``: ``{name: fsdp role with .model and .state}``; collective."""
    dcp.save({name: _state(role) for name, role in roles.items()}, checkpoint_id=folder)


def _clone(value):
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def empty_optimizers(roles: dict) -> list:
    """Optimizers without state yet (declaring their state creates zero states)."""
    return [r.state.optimizer for r in roles.values() if not r.state.optimizer.state]


def forget(optimizers: list) -> None:
    for opt in optimizers:
        opt.state.clear()


def state_for_loading(roles: dict) -> dict:
    """Fresh tensors of the roles' state-dict layout, for ``dcp.load`` to fill."""
    return {name: _clone(_state(role)) for name, role in roles.items()}


def load_roles(folder: str, state: dict) -> dict:
    dcp.load(state, checkpoint_id=folder)
    return state


def apply_loaded(roles: dict, state: dict) -> None:
    for name, role in roles.items():
        set_state_dict(role.model, role.state.optimizer,
                       model_state_dict=state[name]["model"],
                       optim_state_dict=state[name]["optimizer"], options=_options(role.model))


def export_hf(model, folder: str, tokenizer=None) -> None:
    """Write ``model`` (sharded; a causal LM or a ``ValueModel``) as an HF folder, on rank 0;
    collective (every rank takes part in the gather)."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    hf = model
    if isinstance(model, ValueModel):
        hf = model.model
        sd = {k[len("model."):]: v for k, v in sd.items()}
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        tmp = folder.rstrip("/") + ".tmp-export"
        shutil.rmtree(tmp, ignore_errors=True)
        hf.save_pretrained(tmp, state_dict=sd)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    if dist.is_initialized():
        dist.barrier()
