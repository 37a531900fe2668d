"""The declarative weight map of a model family: each mapping ties an HF tensor (or the HF tensors
fused into one parameter) to our parameter and to a megatron-core key, with the rule
(``weight_rules``) that shards / fuses / lays it out. The loader, both savers, ``hf2mcore`` and
``mcore2hf`` all read this one table, through a :class:`WeightMap` they are handed (the registry
picks it per family; nothing here knows the model classes). One WeightMap per registered family
(``parallel_models.llama.families``) is made from the family's names.

megatron-core keys are those of 0.16's ``GPTModel.sharded_state_dict()``. Per-layer keys are
stacked: one tensor with a leading layer axis (``decoder.layers.self_attention.linear_qkv.weight``
is ``[num_layers, rows, hidden]``). Norm names are the transformer-engine ones, which
megatron-core's local spec also saves under (its ``sharded_state_dict_keys_map``);
``LOCAL_SPEC_NAMES`` gives the raw module names of a local spec without that map.
"""

from __future__ import annotations

import dataclasses

import torch

from parallel_models.config import ModelConfig
from parallel_models.llama.checkpoint_utils.megatron_format import (LAYER_SPECS,
                                                                   LOCAL_SPEC_NAMES,
                                                                   MCORE_LAYER_PREFIX,
                                                                   TE_MOE_LAYER_NAMES)
from parallel_models.llama.checkpoint_utils.moe_weight_map import (DEFAULT_MOE_HF_NAMES,
                                                                   add_moe_mappings)
from parallel_models.llama.checkpoint_utils.weight_rules import (FusedGateUp, FusedQKV, Replicated,
                                                                RowSplit, SliceReader, VocabSplit,
                                                                WeightRule)
from parallel_models.llama.families import Family, all_families

@dataclasses.dataclass(frozen=True)
class WeightMapping:
    """One of our parameters <-> its HF tensor(s) <-> its megatron-core key, and its rule.

    ``place``: where the parameter lives: ``pre`` (first pipeline stage), ``layer`` (per layer;
    ``{i}`` in ``ours`` is the local layer index, in ``hf`` the global one) or ``post`` (last
    stage). ``optional``: may be absent from an HF checkpoint (the value head: initialized
    fresh). ``tied_copy``: a copy of another mapping's tensor (a tied last stage's head), never
    written by itself. ``layers``: which layers a per-layer mapping applies to (``all``, or
    ``moe`` / ``dense`` for models mixing MoE and dense MLPs). ``expert``: the global expert of
    a routed-expert mapping (``{e}`` in ``ours`` is its index among this rank's experts)."""

    ours: str
    hf: tuple[str, ...]
    mcore: str
    rule: WeightRule
    place: str = "layer"
    optional: bool = False
    tied_copy: bool = False
    layers: str = "all"
    expert: int | None = None

    @property
    def per_layer(self) -> bool:
        return self.place == "layer"

    def applies_to(self, config: ModelConfig, layer: int | None) -> bool:
        """Whether this mapping has a tensor in global layer ``layer`` (None: non-layer)."""
        if layer is None or self.layers == "all":
            return True
        return config.is_moe_layer(layer) == (self.layers == "moe")

    def ours_name(self, local_layer: int | None, local_expert: int | None = None) -> str:
        """Our parameter name in local layer ``local_layer`` (and local expert index)."""
        if local_layer is None:
            return self.ours
        if self.expert is None:
            return self.ours.format(i=local_layer)
        return self.ours.format(i=local_layer, e=local_expert)

    def mcore_location(self, config: ModelConfig, layer: int | None,
                       layer_spec: str = "mcore-local") -> tuple[str, int | None, int]:
        """(key, leading index, leading size) of this mapping's megatron-core tensor in global
        layer ``layer``, as we write it. Dense models stack the layers under one key (a leading
        layer axis); MoE models are saved per layer (``decoder.layers.{i}.``: megatron-core's
        non-homogeneous layout, which its GPTModel uses when ``moe_layer_freq`` is a list, as we
        write it) with a leading expert axis for the routed experts. Leading index None: no
        leading axis. ``layer_spec``: the key names (:meth:`mcore_key`); the default,
        megatron-core's local spec, is what the trainer's own checkpoints use. (``mcore_reader``
        also reads the stacked MoE layout megatron-core saves for an integer
        ``moe_layer_freq``.)"""
        key = self.mcore_key(layer_spec, moe_layer=layer is not None and config.is_moe_layer(layer))
        if layer is None:
            return key, None, 0
        if not config.is_moe:
            return key, layer, config.num_layers
        key = key.replace(MCORE_LAYER_PREFIX, f"{MCORE_LAYER_PREFIX}{layer}.", 1)
        if self.expert is not None:
            return key, self.expert, config.num_experts
        return key, None, 0

    def local_expert(self, config: ModelConfig, ep: int, ep_rank: int) -> int | None:
        """This mapping's expert index on EP rank ``ep_rank`` (None: another rank's expert)."""
        per = config.num_experts // ep
        e = self.expert - ep_rank * per
        return e if 0 <= e < per else None

    def expert_owner(self, config: ModelConfig, ep: int) -> int:
        """The EP rank holding this mapping's expert."""
        return self.expert // (config.num_experts // ep)

    def hf_names(self, layer: int | None) -> tuple[str, ...]:
        """The HF names for global layer ``layer`` (None for non-layer tensors)."""
        return tuple(n.format(i=layer) for n in self.hf) if layer is not None else self.hf

    def mcore_key(self, layer_spec: str = "mcore-local", moe_layer: bool = False) -> str:
        """The megatron-core key under a layer spec's naming (``LAYER_SPECS``): ``te`` (the
        transformer-engine spec: norms fused into the next linear, except an MoE layer's pre-MLP
        norm, a separate ``pre_mlp_layernorm``), ``mcore-local`` (megatron-core's local spec,
        whose ``sharded_state_dict_keys_map`` saves every norm under the fused names, MoE layers
        included) or ``local`` (a local spec without that map: the norms' module names).
        ``moe_layer``: the key of a tensor in an MoE layer."""
        if layer_spec not in LAYER_SPECS:
            raise ValueError(f"layer_spec must be one of {', '.join(LAYER_SPECS)}, got "
                             f"{layer_spec!r}")
        if layer_spec == "local" or (layer_spec == "te" and moe_layer
                                     and self.mcore in TE_MOE_LAYER_NAMES):
            return LOCAL_SPEC_NAMES.get(self.mcore, self.mcore)
        return self.mcore


def llama_mappings(config: ModelConfig, head_kind: str, *, pre_process: bool = True,
                   post_process: bool = True,
                   moe_hf_names: tuple = DEFAULT_MOE_HF_NAMES) -> list[WeightMapping]:
    """The Llama-style decoder (every family): mappings of one (pipeline stage of a) model with a
    CausalLM or Value head; ``moe_hf_names``: the family's HF names of the MoE tensors."""
    L = "model.layers.{i}."
    M = MCORE_LAYER_PREFIX
    out: list[WeightMapping] = []
    if pre_process:
        out.append(WeightMapping("model.embed_tokens.weight", ("model.embed_tokens.weight",),
                                 "embedding.word_embeddings.weight", VocabSplit(), "pre"))

    # dense-MLP mappings skip the MoE layers of a model that has some
    mlp_layers = "dense" if config.is_moe else "all"

    def layer(ours, hf, mcore, rule, layers="all", expert=None):
        out.append(WeightMapping(L + ours, tuple(L + n for n in hf), M + mcore, rule,
                                 layers=layers, expert=expert))

    layer("input_layernorm.weight", ("input_layernorm.weight",),
          "self_attention.linear_qkv.layer_norm_weight", Replicated("hidden"))
    layer("self_attn.qkv_proj.weight", tuple(f"self_attn.{p}_proj.weight" for p in "qkv"),
          "self_attention.linear_qkv.weight", FusedQKV())
    layer("self_attn.o_proj.weight", ("self_attn.o_proj.weight",),
          "self_attention.linear_proj.weight", RowSplit("hidden", "q"))
    layer("post_attention_layernorm.weight", ("post_attention_layernorm.weight",),
          "mlp.linear_fc1.layer_norm_weight", Replicated("hidden"))
    layer("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
          "mlp.linear_fc1.weight", FusedGateUp(), layers=mlp_layers)
    layer("mlp.down_proj.weight", ("mlp.down_proj.weight",), "mlp.linear_fc2.weight",
          RowSplit("hidden", "ffn"), layers=mlp_layers)
    if config.is_moe:
        add_moe_mappings(config, moe_hf_names, layer)
    if config.qk_norm:  # Qwen3: one RMSNorm weight over head_dim for all q (and all k) heads
        layer("self_attn.q_layernorm.weight", ("self_attn.q_norm.weight",),
              "self_attention.q_layernorm.weight", Replicated("head_dim"))
        layer("self_attn.k_layernorm.weight", ("self_attn.k_norm.weight",),
              "self_attention.k_layernorm.weight", Replicated("head_dim"))
    if config.qkv_bias:
        layer("self_attn.qkv_proj.bias", tuple(f"self_attn.{p}_proj.bias" for p in "qkv"),
              "self_attention.linear_qkv.bias", FusedQKV(bias=True))
    if config.o_bias:
        layer("self_attn.o_proj.bias", ("self_attn.o_proj.bias",),
              "self_attention.linear_proj.bias", Replicated("hidden"))
    if config.mlp_bias:
        layer("mlp.gate_up_proj.bias", ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
              "mlp.linear_fc1.bias", FusedGateUp(bias=True), layers=mlp_layers)
        layer("mlp.down_proj.bias", ("mlp.down_proj.bias",), "mlp.linear_fc2.bias",
              Replicated("hidden"), layers=mlp_layers)
    if post_process:
        out.append(WeightMapping("model.norm.weight", ("model.norm.weight",),
                                 "decoder.final_layernorm.weight", Replicated("hidden"), "post"))
        if head_kind == "value":
            # a value head is megatron's output layer with one row (verl's critic layout)
            out.append(WeightMapping("value_head.weight", ("score.weight",), "output_layer.weight",
                                     Replicated("one", "hidden"), "post", optional=True))
        elif not config.tie_word_embeddings:
            out.append(WeightMapping("lm_head.proj.weight", ("lm_head.weight",),
                                     "output_layer.weight", VocabSplit(), "post"))
        elif not pre_process:
            # a last pipeline stage with tied embeddings keeps its own copy of the embedding
            # (megatron-core saves it as a non-main replica of the embedding)
            out.append(WeightMapping("lm_head.proj.weight", ("model.embed_tokens.weight",),
                                     "embedding.word_embeddings.weight", VocabSplit(), "post",
                                     tied_copy=True))
    return out


@dataclasses.dataclass(frozen=True)
class WeightMap:
    """A family's weight map: its name (the prefix of its HF architecture strings), the HF
    architectures it serves and the HF names of its MoE tensors (None: dense / Qwen's)."""

    family: str
    architectures: tuple[str, ...]
    moe_hf_names: tuple | None = None

    @classmethod
    def of_family(cls, family: Family) -> "WeightMap":
        return cls(family.name, family.architectures, family.moe_hf_names)

    def mappings(self, config: ModelConfig, head_kind: str, *, pre_process: bool = True,
                 post_process: bool = True) -> list[WeightMapping]:
        if head_kind not in ("causal_lm", "value"):
            raise ValueError(f"head_kind must be 'causal_lm' or 'value', got {head_kind!r}")
        return llama_mappings(config, head_kind, pre_process=pre_process,
                              post_process=post_process,
                              moe_hf_names=self.moe_hf_names or DEFAULT_MOE_HF_NAMES)

    def architecture(self, head_kind: str) -> str:
        """The HF architecture string a saved model of this family declares."""
        return f"{self.family}For{'SequenceClassification' if head_kind == 'value' else 'CausalLM'}"

    def global_jobs(self, config: ModelConfig, head_kind: str
                    ) -> list[tuple[WeightMapping, int | None]]:
        """Every (mapping, global layer) of the whole model in save order: the first stage's
        tensors, layer by layer, the last stage's. All ranks walk this same list."""
        maps = self.mappings(config, head_kind)
        return ([(m, None) for m in maps if m.place == "pre"]
                + [(m, i) for i in range(config.num_layers) for m in maps
                   if m.place == "layer" and m.applies_to(config, i)]
                + [(m, None) for m in maps if m.place == "post"])


# one weight map per registered family, by family name ("Llama", "Qwen3Moe", ...)
WEIGHT_MAPS = tuple(WeightMap.of_family(f) for f in all_families())
WEIGHT_MAPS_BY_FAMILY = {wm.family: wm for wm in WEIGHT_MAPS}
LLAMA = WEIGHT_MAPS_BY_FAMILY["Llama"]
QWEN2 = WEIGHT_MAPS_BY_FAMILY["Qwen2"]
QWEN3 = WEIGHT_MAPS_BY_FAMILY["Qwen3"]
QWEN2_MOE = WEIGHT_MAPS_BY_FAMILY["Qwen2Moe"]
QWEN3_MOE = WEIGHT_MAPS_BY_FAMILY["Qwen3Moe"]
MIXTRAL = WEIGHT_MAPS_BY_FAMILY["Mixtral"]

# ---- shorthands kept for callers of the Llama layout (tests, model checks) ------------------------------
def weight_rules(config: ModelConfig, head_kind: str, *, pre_process: bool = True,
                 post_process: bool = True) -> list[WeightMapping]:
    """The Llama-layout mappings (every family here shares them)."""
    return llama_mappings(config, head_kind, pre_process=pre_process, post_process=post_process)


def shard_from_hf(mapping: WeightMapping, names: tuple[str, ...], read: SliceReader,
                  config: ModelConfig, tp: int, rank: int) -> torch.Tensor:
    """This rank's shard of one of our parameters, read slice by slice from HF tensors."""
    return mapping.rule.shard(read, names, config, tp, rank)


def merge_to_hf(mapping: WeightMapping, shards: list[torch.Tensor], config: ModelConfig
                ) -> list[torch.Tensor]:
    """The TP shards of one parameter (by rank) -> its HF tensors."""
    return mapping.rule.merge(shards, config)


__all__ = ["WeightMapping", "WeightMap", "LLAMA", "QWEN2", "QWEN3", "QWEN2_MOE", "QWEN3_MOE",
           "MIXTRAL", "WEIGHT_MAPS", "WEIGHT_MAPS_BY_FAMILY", "llama_mappings",
           "weight_rules", "shard_from_hf", "merge_to_hf"]
