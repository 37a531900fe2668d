"""Add LoRA adapters to a built model by PEFT module names, freeze the base, switch them off.

``add_lora(model, settings)`` works on one model or a list of pipeline chunks: each decoder
layer's attention (``qkv_proj``: ``q_proj``/``k_proj``/``v_proj``; ``o_proj``) and dense MLP
(``gate_up_proj``: ``gate_proj``/``up_proj``; ``down_proj``) get the targeted adapters, every
other parameter is frozen (``requires_grad=False``; the base weights stay where they are, no
copy) but a value model's head (``value_head``, HF's ``score``), which stays trainable whole as
PEFT's ``SEQ_CLS`` task keeps it (``modules_to_save``).

On an MoE layer the MLP targets adapt the routed experts as PEFT's ``target_parameters`` do
(``lora/experts.py``: ``gate_proj`` + ``up_proj`` -> ``mlp.experts.gate_up_proj``, ``down_proj``
-> ``mlp.experts.down_proj``, per-expert A and B of rank r) and the shared expert's linears as
PEFT's ``target_modules`` names reach them (Qwen2-MoE: ``mlp.shared_expert.gate_proj`` ...; its
sigmoid gate and the router take none). Refused (ConfigError), as PEFT cannot express them:
only one of ``gate_proj`` / ``up_proj`` (fused in one parameter), dropout on expert adapters,
and MLP targets on a family whose MLP names PEFT's transformers-5 conversion turns into the
experts' parameters (Qwen3-MoE) while it also has linear MLPs (dense layers) those names would
have to reach. ``all-linear`` means every projection above (the export lists them by name).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from parallel_models.config import ConfigError
from megatron.core.tensor_parallel.layers import RowParallelLinear

from parallel_models.lora.config import MLP_TARGETS, LoraSettings
from parallel_models.lora.experts import ExpertLora, attach_experts
from parallel_models.lora.layers import ColumnLora, RowLora, attach, init_full_a
from parallel_models.llama.layers.linear import GateUpParallelLinear, QKVParallelLinear

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def _unwrap(chunk) -> torch.nn.Module:
    """The model inside a DDP (or other ``.module``) wrapper."""
    while hasattr(chunk, "module") and not hasattr(chunk, "parallel_layout"):
        chunk = chunk.module
    return chunk


def model_chunks(model) -> list[torch.nn.Module]:
    return [_unwrap(c) for c in (model if isinstance(model, (list, tuple)) else [model])]


def _seed(settings: LoraSettings, layer_id: int, name: str) -> int:
    """The generator seed of one projection's A: the same on every rank and every layout."""
    from parallel_models.lora.config import ALL_TARGETS

    return (settings.init_seed * 1_000_003 + layer_id) * 16 + ALL_TARGETS.index(name)


def lora_linears(model) -> Iterator[tuple[int, str, torch.nn.Module]]:
    """``(global layer id, "self_attn.qkv_proj" | ..., linear)`` of every linear that can take
    adapters, over the chunks of ``model``."""
    for chunk in model_chunks(model):
        for layer in chunk.model.layers:
            attn = layer.self_attn
            yield layer.layer_id, "self_attn.qkv_proj", attn.qkv_proj
            yield layer.layer_id, "self_attn.o_proj", attn.o_proj
            mlp = getattr(layer.mlp, "gate_up_proj", None)
            if isinstance(mlp, GateUpParallelLinear):
                yield layer.layer_id, "mlp.gate_up_proj", layer.mlp.gate_up_proj
                yield layer.layer_id, "mlp.down_proj", layer.mlp.down_proj
            shared = getattr(layer.mlp, "shared_experts", None)
            if shared is not None:  # megatron-core's SharedExpertMLP: HF's mlp.shared_expert
                yield layer.layer_id, "mlp.shared_expert.gate_up_proj", shared.linear_fc1
                yield layer.layer_id, "mlp.shared_expert.down_proj", shared.linear_fc2
            if hasattr(layer.mlp, "experts"):
                yield layer.layer_id, "mlp.experts", layer.mlp.experts


def _column_blocks(linear) -> list[tuple[str, int]]:
    if isinstance(linear, QKVParallelLinear):
        return [("q_proj", linear.q_size), ("k_proj", linear.kv_size), ("v_proj", linear.kv_size)]
    half = linear.weight.shape[0] // 2
    return [("gate_proj", half), ("up_proj", half)]


def _peft_moves_mlp_names(model_type: str) -> bool:
    """Whether PEFT's transformers-5 conversion (``peft.utils.transformers_weight_conversion``)
    turns ``target_modules`` ``gate_proj`` / ``up_proj`` / ``down_proj`` of this model type
    into its experts' ``target_parameters`` (so those names reach no linear MLP)."""
    try:
        from peft.utils.transformers_weight_conversion import (_MODEL_TO_CONVERSION_PATTERN,
                                                                _MOE_TARGET_MODULE_MAPPING)
    except ImportError:
        return False
    mapping = _MOE_TARGET_MODULE_MAPPING.get(_MODEL_TO_CONVERSION_PATTERN.get(model_type), {})
    return bool(set(MLP_TARGETS) & set(mapping))


def check_moe_targets(config, settings: LoraSettings) -> None:
    """A ConfigError for what PEFT cannot express on the MoE model of ``config`` (a
    ``ModelConfig``), see the module doc."""
    mlp = [t for t in settings.target_modules if t in MLP_TARGETS]
    if not mlp:
        return
    if ("gate_proj" in mlp) != ("up_proj" in mlp):
        raise ConfigError(
            f"lora target_modules {mlp} on an MoE model: gate_proj and up_proj are one fused "
            "parameter of the experts (transformers' mlp.experts.gate_up_proj, which PEFT "
            "adapts whole through target_parameters); target both or neither")
    if settings.dropout:
        raise ConfigError(
            f"lora dropout={settings.dropout} with MLP target_modules {mlp} on an MoE model: "
            "PEFT's expert adapters (ParamWrapper) refuse dropout; set dropout to 0 or target "
            "the attention projections only (q_proj, k_proj, v_proj, o_proj)")
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    if (dense or config.shared_expert_intermediate_size) and \
            _peft_moves_mlp_names(config.model_type):
        raise ConfigError(
            f"lora target_modules {mlp} on {config.architecture}: PEFT (transformers 5) turns "
            f"these names into the experts' target_parameters for model_type "
            f"{config.model_type!r}, so they cannot also reach its linear MLPs (dense layers "
            f"{dense}{', a shared expert' if config.shared_expert_intermediate_size else ''}); "
            "target the attention projections only (q_proj, k_proj, v_proj, o_proj)")


def _check_layout(chunk, settings: LoraSettings) -> None:
    config = chunk.config
    tp = chunk.tp
    if config.is_moe:
        check_moe_targets(config, settings)
    if tp > config.num_key_value_heads and {"k_proj", "v_proj"} & set(settings.target_modules):
        raise ConfigError(f"lora target_modules k_proj/v_proj with tensor_parallel_size ({tp}) > "
                          f"num_key_value_heads ({config.num_key_value_heads}) is not supported "
                          "(replicated KV heads)")


def peft_adapter_config(settings: LoraSettings, config, value_head: bool = False) -> dict:
    """``settings``' ``adapter_config.json`` for the model of ``config`` (a ``ModelConfig``): on
    an MoE model the experts' ``target_parameters``, its MLP names only where a linear MLP (a
    dense layer, a shared expert) takes them."""
    if not config.is_moe:
        return settings.peft_config(value_head=value_head)
    dense = any(not config.is_moe_layer(i) for i in range(config.num_layers))
    return settings.peft_config(value_head=value_head, experts=True,
                                linear_mlp=dense or bool(config.shared_expert_intermediate_size))


def seed_experts(settings: LoraSettings, layer_id: int, proj: str) -> int:
    """The A seed of a layer's expert adapters (apart from the dense projections' seeds)."""
    return _seed(settings, layer_id, "gate_proj" if proj == "gate_up_proj" else proj) + 8


def _add_expert_adapters(layer_id: int, experts, settings: LoraSettings) -> None:
    targets = set(settings.target_modules)
    wanted = [p for p, t in (("gate_up_proj", "gate_proj"), ("down_proj", "down_proj"))
              if t in targets]
    if not wanted:
        return
    lora = ExpertLora(experts, settings.scale)
    attach_experts(experts, lora)
    for proj in wanted:
        w = lora.linear(proj, 0).weight
        full_in = w.shape[1] * (lora.tp if proj == "down_proj" else 1)
        lora.add(proj, settings.rank, init_full_a(settings.rank * lora.num_local * lora.ep,
                                                  full_in, seed_experts(settings, layer_id, proj)))


def add_lora(model, settings: LoraSettings) -> int:
    """Add ``settings``' adapters to ``model`` (a model or its pipeline chunks), freeze every
    other parameter (a value head stays trainable); returns the number of trainable
    parameters on this rank."""
    chunks = model_chunks(model)
    if any(hasattr(lin, "lora") for _, _, lin in lora_linears(chunks)):
        raise ConfigError("add_lora: the model already has LoRA adapters")
    for chunk in chunks:
        _check_layout(chunk, settings)
        for p in chunk.parameters():
            p.requires_grad_(False)
        head = getattr(chunk, "value_head", None)
        if head is not None:  # PEFT's SEQ_CLS modules_to_save: the head is trained whole
            head.weight.requires_grad_(True)
    targets = set(settings.target_modules)
    for layer_id, where, linear in lora_linears(chunks):
        if where == "mlp.experts":
            _add_expert_adapters(layer_id, linear, settings)
            continue
        if isinstance(linear, RowParallelLinear):
            name = "o_proj" if where.endswith("o_proj") else "down_proj"
            if name not in targets:
                continue
            lora = RowLora(linear, name, settings.scale, settings.dropout)
            attach(linear, lora)
            tp_rank = torch.distributed.get_group_rank(linear.tp_group, torch.distributed.get_rank()) \
                if lora.tp > 1 else 0
            full_in = linear.weight.shape[1] * lora.tp
            lora.add(name, settings.rank, init_full_a(settings.rank, full_in,
                                                      _seed(settings, layer_id, name)), tp_rank)
            continue
        blocks = _column_blocks(linear)
        wanted = [n for n, _ in blocks if n in targets]
        if not wanted:
            continue
        lora = ColumnLora(linear, blocks, settings.scale, settings.dropout)
        attach(linear, lora)
        for name in wanted:
            lora.add(name, settings.rank, init_full_a(settings.rank, linear.weight.shape[1],
                                                      _seed(settings, layer_id, name)))
    for chunk in chunks:
        chunk.lora_settings = settings
    return trainable_parameter_count(chunks)


def trainable_parameter_count(model) -> int:
    """Parameters with ``requires_grad`` on this rank (the adapters once LoRA is on)."""
    return sum(p.numel() for c in model_chunks(model) for p in c.parameters() if p.requires_grad)


def has_lora(model) -> bool:
    return any(getattr(c, "lora_settings", None) is not None for c in model_chunks(model))


def lora_modules(model) -> Iterator[tuple[int, str, torch.nn.Module]]:
    """``(global layer id, where, ColumnLora | RowLora)`` of every linear with adapters."""
    for layer_id, where, linear in lora_linears(model):
        if hasattr(linear, "lora"):
            yield layer_id, where, linear.lora


@contextlib.contextmanager
def adapters_disabled(model):
    """Run the base model: every adapter switched off inside the block (the reference policy)."""
    mods = [m for _, _, m in lora_modules(model)]
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m, was in zip(mods, before):
            m.enabled = was


@contextlib.contextmanager
def adapters_merged(model):
    """Inside the block the base weights hold ``W + scale * B @ A`` and the adapters are off
    (what an exporter or a rollout engine without LoRA reads); restored exactly on exit. The
    merged tensors are new ones: the targeted weights exist twice while inside."""
    mods = [m for _, _, m in lora_modules(model)]
    saved, enabled = [], [m.enabled for m in mods]
    with torch.no_grad():
        for m in mods:
            for weight, delta in list(m.merged_weights()):
                saved.append((weight, weight.data))
                weight.data = weight.data + delta.to(weight.dtype)
            m.enabled = False
    try:
        yield
    finally:
        for weight, data in saved:
            weight.data = data
        for m, was in zip(mods, enabled):
            m.enabled = was
