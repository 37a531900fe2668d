"""HF ``architectures`` string -> model family -> variant classes.

Every family is the one Llama-style decoder (``parallel_models.llama.modeling``) under another
name: the differences (qkv bias, tied embeddings, rope scaling, Qwen3's per-head q/k norm and
explicit head_dim, mixture-of-experts MLPs, Gemma's norm / activation / embedding scale) come
from the HF config as the family reads it (``ModelConfig.from_hf``). The families are the
registered ones (``parallel_models.llama.families``), each with its weight map
(``checkpoint_utils.WEIGHT_MAPS``); class names follow ``{Family}For{CausalLM|Value}[RmPad][PP]``,
e.g. ``Qwen3ForValueRmPadPP``.
"""

from __future__ import annotations

import os

from parallel_models.config import ConfigError, load_hf_config
from parallel_models.llama.checkpoint_utils import (WEIGHT_MAPS, WeightMap, is_mcore_checkpoint,
                                                   model_config_of, resolve_model_path)
from parallel_models.llama.modeling import CausalLM, CausalLMRmPad, ParallelModel, Value, ValueRmPad

# family name -> its weight map (which also lists the HF architecture strings it serves)
FAMILIES: dict[str, WeightMap] = {wm.family: wm for wm in WEIGHT_MAPS}
_BASES = {("causal_lm", False): CausalLM, ("causal_lm", True): CausalLMRmPad,
          ("value", False): Value, ("value", True): ValueRmPad}
_HEAD_NAMES = {"causal_lm": "CausalLM", "value": "Value"}

# HF architecture string -> family. Sequence-classification checkpoints (reward models) map to
# the same family; the head is chosen by the caller.
ARCHITECTURES = {arch: wm.family for wm in WEIGHT_MAPS for arch in wm.architectures}

_CLASSES: dict[str, type[ParallelModel]] = {}


def _class_name(family: str, head: str, rmpad: bool, pp: bool) -> str:
    return f"{family}For{_HEAD_NAMES[head]}{'RmPad' if rmpad else ''}{'PP' if pp else ''}"


def _make(family: str, head: str, rmpad: bool, pp: bool) -> type[ParallelModel]:
    name = _class_name(family, head, rmpad, pp)
    base = _BASES[(head, rmpad)]
    stage = (" Built for one pipeline stage (this rank's, or ``vpp_chunk``); the schedules in "
             "``parallel_models.pipeline`` run it.") if pp else ""
    cls = type(name, (base,), {"__module__": "parallel_models.models",
                               "__doc__": f"{family} as {base.__name__}.{stage} {base.__doc__}",
                               "architecture": f"{family}ForCausalLM",
                               "weight_map": FAMILIES[family],
                               "pipeline_stage": pp})
    _CLASSES[name] = cls
    return cls


for _family in FAMILIES:
    for (_head, _rmpad) in _BASES:
        for _pp in (False, True):
            _make(_family, _head, _rmpad, _pp)


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def family_of(architecture: str) -> str:
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"unsupported architecture {architecture!r}; supported: "
                          f"{', '.join(supported_architectures())}")
    return ARCHITECTURES[architecture]


def weight_map_of(architecture: str) -> WeightMap:
    """The weight map of an HF architecture string's family (clear error when unsupported)."""
    return FAMILIES[family_of(architecture)]


def get_model_class(architecture: str, head: str = "causal_lm", rmpad: bool = False,
                    pp: bool = False) -> type[ParallelModel]:
    """The variant class for an HF architecture string, e.g. ('Qwen2ForCausalLM', 'value', True)
    -> ``Qwen2ForValueRmPad``."""
    if head not in _HEAD_NAMES:
        raise ValueError(f"head must be one of {sorted(_HEAD_NAMES)}, got {head!r}")
    family = family_of(architecture)
    return _CLASSES[_class_name(family, head, rmpad, pp)]


def all_classes() -> dict[str, type[ParallelModel]]:
    """Every variant class by its public name (the names ``parallel_models.models`` exports)."""
    return dict(_CLASSES)


def model_class(name: str) -> type[ParallelModel]:
    """A variant class by its public name, e.g. 'LlamaForCausalLMRmPad'."""
    if name not in _CLASSES:
        raise ConfigError(f"unknown model class {name!r}; available: {', '.join(sorted(_CLASSES))}")
    return _CLASSES[name]


def architecture_of(path: str) -> str:
    """The first ``architectures`` entry of an HF folder's config (clear error when absent)."""
    path = resolve_model_path(path)
    hf_config = (model_config_of(path).hf_config if is_mcore_checkpoint(path)
                 else load_hf_config(path))  # a Megatron-LM / Bridge folder: from its settings
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ConfigError(f"{os.path.join(path, 'config.json')}: no 'architectures' entry; "
                          f"supported: {', '.join(supported_architectures())}")
    return archs[0]


class _AutoModel:
    head: str = "causal_lm"

    @classmethod
    def from_pretrained(cls, path: str, *, rmpad: bool = False, pp: bool = False, **kwargs
                        ) -> ParallelModel:
        """Pick the class from the folder's ``architectures`` and load this rank's shard."""
        return get_model_class(architecture_of(path), cls.head, rmpad, pp).from_pretrained(
            path, **kwargs)


class AutoModelForCausalLM(_AutoModel):
    head = "causal_lm"


class AutoModelForValue(_AutoModel):
    head = "value"
