"""PEFT adapter folders: gather our TP/PP-sharded adapters into PEFT's tensors and names, write
``adapter_config.json`` + ``adapter_model.safetensors``, and load such a folder into a model.

PEFT names a tensor ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` (the
saved names drop the adapter name ``default``; an MoE layer's expert adapters are
``...mlp.experts[.base_layer].lora_A.weight``, ``lora/experts.py``, gathered over the expert-
parallel ranks too); ``peft.PeftModel.from_pretrained(base, folder)``
reads what :func:`save_adapter` writes. Gathering (call on every rank): the TP ranks of a stage
all-gather each adapter's slices (column layers' B rows, row layers' A columns; the replicated
halves are taken from any rank), then the first TP rank of the first data-parallel replica of
every pipeline stage sends its layers to global rank 0, which writes. Adapters are small (rank
x hidden per projection): they travel as one object per stage. A value model (the critic) adds
its head as PEFT's ``SEQ_CLS`` task saves its ``modules_to_save``: ``base_model.model.score.weight``
(replicated over TP, on the last pipeline stage).
"""

from __future__ import annotations

import json
import os
import re

import torch
import torch.distributed as dist

from parallel_models.config import ConfigError
from parallel_models.lora.apply import (add_lora, lora_modules, model_chunks,
                                        peft_adapter_config)
from parallel_models.lora.config import LoraSettings
from parallel_models.lora.experts import ExpertLora, peft_module
from parallel_models.lora.layers import ColumnLora

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers."
SCORE = "base_model.model.score.weight"  # a value model's head (PEFT's modules_to_save)
_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.([\w.]+)\.lora_"
                   r"([AB])\.weight$")


def peft_name(layer_id: int, where: str, projection: str, which: str) -> str:
    """PEFT's saved name of one adapter matrix of a linear (``which``: ``"A"`` or ``"B"``)."""
    parent = where.rsplit(".", 1)[0]
    return f"{PREFIX}{layer_id}.{parent}.{projection}.lora_{which}.weight"


def adapter_name(layer_id: int, where: str, lora, projection: str, which: str) -> str:
    """PEFT's saved name of one adapter matrix of ``lora`` (linear or experts)."""
    if isinstance(lora, ExpertLora):
        return f"{PREFIX}{layer_id}.{peft_module(tuple(lora.adapters), projection)}.lora_{which}.weight"
    return peft_name(layer_id, where, projection, which)


def adapter_matrices(model):
    """``(PEFT name, lora module, projection, "A" | "B", parameter)`` of every adapter matrix."""
    for layer_id, where, lora in lora_modules(model):
        for proj, ad in lora.adapters.items():
            for which, lin in (("A", ad.lora_A), ("B", ad.lora_B)):
                yield adapter_name(layer_id, where, lora, proj, which), lora, proj, which, lin.weight


def _split_dims(lora) -> tuple[int | None, int | None]:
    """(A's TP split dim, B's): column: A whole, B rows; row: A columns, B whole."""
    return (None, 0) if isinstance(lora, ColumnLora) else (1, None)


def _tp_rank(lora) -> int:
    return dist.get_group_rank(lora.tp_group, dist.get_rank()) if lora.tp > 1 else 0


def _value_heads(model) -> list[torch.nn.Module]:
    return [c.value_head for c in model_chunks(model) if getattr(c, "value_head", None) is not None]


def is_value_model(model) -> bool:
    return model_chunks(model)[0].head_kind == "value"


def _data_parallel_rank() -> int:
    if not dist.is_initialized():
        return 0
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_rank() if mpu.model_parallel_is_initialized() else 0


def gather_adapter_tensors(model, grads: bool = False) -> dict[str, torch.Tensor] | None:
    """Every adapter matrix (or its gradient: ``grads=True``) at its full size under PEFT's
    name, on global rank 0 (None elsewhere; a dict on a run without torch.distributed). Call
    on every rank."""
    local: dict[str, torch.Tensor] = {}
    first = True
    for name, lora, proj, which, param in adapter_matrices(model):
        t = param.grad if grads else param
        if t is None:
            raise ConfigError(f"gather_adapter_tensors: {name} has no gradient")
        t = t.detach()
        if isinstance(lora, ExpertLora):
            t = lora.gather_full(proj, which, t)
            first = first and lora.tp_rank == 0
        else:
            dim = _split_dims(lora)[0 if which == "A" else 1]
            if dim is not None and lora.tp > 1:
                parts = [torch.empty_like(t) for _ in range(lora.tp)]
                dist.all_gather(parts, t.contiguous(), group=lora.tp_group)
                t = torch.cat(parts, dim=dim)
            first = first and _tp_rank(lora) == 0
        local[name] = t.cpu().clone()
    for head in _value_heads(model):  # replicated over TP: any rank's
        t = head.weight.grad if grads else head.weight
        if t is None:
            raise ConfigError(f"gather_adapter_tensors: {SCORE} has no gradient")
        local[SCORE] = t.detach().cpu().clone()
    if not dist.is_initialized():
        return local
    sender = first and _data_parallel_rank() == 0
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local if sender else {}, parts, dst=0)
    if dist.get_rank() != 0:
        return None
    out: dict[str, torch.Tensor] = {}
    for p in parts:
        out.update(p)
    return dict(sorted(out.items(), key=lambda kv: _sort_key(kv[0])))


def _sort_key(name: str):
    m = _NAME.match(name)
    return (int(m.group(1)), name) if m else (-1, name)


def _peft_config(settings: LoraSettings, chunks) -> dict:
    return peft_adapter_config(settings, chunks[0].config, value_head=is_value_model(chunks))


def save_adapter(model, out_dir: str, base_model_name_or_path: str | None = None) -> str | None:
    """Write ``model``'s adapters as a PEFT adapter folder at ``out_dir`` (call on every rank;
    rank 0 writes). Returns the folder on rank 0."""
    from safetensors.torch import save_file

    chunks = model_chunks(model)
    settings: LoraSettings | None = getattr(chunks[0], "lora_settings", None)
    if settings is None:
        raise ConfigError("save_adapter: the model has no LoRA adapters (add_lora first)")
    tensors = gather_adapter_tensors(chunks)
    if tensors is None:
        return None
    os.makedirs(out_dir, exist_ok=True)
    cfg = _peft_config(settings, chunks)
    cfg["base_model_name_or_path"] = (base_model_name_or_path
                                      or getattr(chunks[0], "name_or_path", None))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    return out_dir


def load_adapter_tensors(model, tensors: dict[str, torch.Tensor]) -> None:
    """Copy full-size PEFT-named adapter tensors into this rank's slices of ``model``'s
    adapters (and a value model's head, ``SCORE``). Every adapter of the model must be there;
    names of layers this rank does not hold are skipped, anything else unknown is a
    ConfigError."""
    with torch.no_grad():
        for head in _value_heads(model):
            if SCORE not in tensors:
                raise ConfigError(f"adapter: missing {SCORE} (the value head)")
            if tuple(tensors[SCORE].shape) != tuple(head.weight.shape):
                raise ConfigError(f"adapter: {SCORE} has shape {tuple(tensors[SCORE].shape)}, "
                                  f"the value head's is {tuple(head.weight.shape)}")
            head.weight.copy_(tensors[SCORE])
        for name, lora, proj, which, param in adapter_matrices(model):
            if name not in tensors:
                raise ConfigError(f"adapter: missing {name}")
            t = tensors[name]
            if isinstance(lora, ExpertLora):
                t = _expert_slice(lora, proj, which, t, name)
            else:
                dim = _split_dims(lora)[0 if which == "A" else 1]
                if dim is not None and lora.tp > 1:
                    t = t.chunk(lora.tp, dim=dim)[_tp_rank(lora)]
            if tuple(t.shape) != tuple(param.shape):
                raise ConfigError(f"adapter: {name} has shape {tuple(tensors[name].shape)}, "
                                  f"the model's slice is {tuple(param.shape)} (TP {lora.tp})")
            param.copy_(t)
    unknown = [n for n in tensors if not _NAME.match(n)
               and not (n == SCORE and is_value_model(model))]
    if unknown:
        raise ConfigError(f"adapter: tensors with names we do not know: {unknown[:4]}")


def _expert_slice(lora: ExpertLora, proj: str, which: str, t: torch.Tensor, name: str):
    """This rank's slice of PEFT's full expert tensor ``t`` (a ConfigError if its shape is
    not ``[E * r, in]`` / ``[out, r * E]`` of this layer)."""
    ad = lora.adapters[proj]
    rank = ad.lora_A.weight.shape[1]
    experts = lora.num_local * lora.ep
    a_in = ad.lora_A.weight.shape[2] * (lora.tp if proj == "down_proj" else 1)
    b_out = ad.lora_B.weight.shape[1] * (lora.tp if proj == "gate_up_proj" else 1)
    want = (experts * rank, a_in) if which == "A" else (b_out, rank * experts)
    if tuple(t.shape) != want:
        raise ConfigError(f"adapter: {name} has shape {tuple(t.shape)}, this layer's {experts} "
                          f"experts at rank {rank} need {want}")
    return lora.local_slice(proj, which, t)


def load_adapter(model, folder: str) -> LoraSettings:
    """Load a PEFT adapter folder into ``model`` (adds the adapters first if it has none)."""
    from safetensors.torch import load_file

    cfg_path = os.path.join(folder, ADAPTER_CONFIG)
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"{folder}: no {ADAPTER_CONFIG} (not a PEFT adapter folder)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    settings = LoraSettings.from_peft_config(cfg)
    chunks = model_chunks(model)
    value = is_value_model(chunks)
    if (cfg.get("task_type") == "SEQ_CLS") != value:
        raise ConfigError(f"{folder}: a {cfg.get('task_type')} adapter does not fit a "
                          f"{'value' if value else 'causal_lm'} model")
    current = getattr(chunks[0], "lora_settings", None)
    if current is None:
        add_lora(chunks, settings)
    elif (current.rank, current.alpha, current.target_modules) != (
            settings.rank, settings.alpha, settings.target_modules):
        raise ConfigError(f"{folder}: adapter r={settings.rank} alpha={settings.alpha} targets="
                          f"{settings.target_modules} differs from the model's r={current.rank} "
                          f"alpha={current.alpha} targets={current.target_modules}")
    load_adapter_tensors(chunks, load_file(os.path.join(folder, ADAPTER_WEIGHTS)))
    return settings
