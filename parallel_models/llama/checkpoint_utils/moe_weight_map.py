"""The MoE part of the weight map: router, routed experts and the shared expert (with its gate) of
Qwen3-MoE, Qwen2-MoE and Mixtral, as HF names, our parameter names and megatron-core keys.

Called by ``weight_map.llama_mappings`` for a config with MoE layers; the mappings it adds apply
to the MoE layers only (``layers="moe"``), and each routed-expert mapping names one global expert
(``expert=e``): our parameter is ``local_experts.{e}`` with ``e`` the index within this rank's
experts (expert parallel), filled in by whoever builds the parameter name.

HF names (as ``save_pretrained`` of transformers 5 writes them, one tensor per expert):
- Qwen2-MoE / Qwen3-MoE: ``mlp.gate.weight``, ``mlp.experts.{e}.{gate,up,down}_proj.weight``,
  Qwen2-MoE also ``mlp.shared_expert.{gate,up,down}_proj.weight`` and ``mlp.shared_expert_gate``;
- Mixtral: ``block_sparse_moe.gate.weight``, ``block_sparse_moe.experts.{e}.w1`` (gate),
  ``w3`` (up), ``w2`` (down).
megatron-core keys are those its MoE layer's ``sharded_state_dict`` writes (local spec,
``SequentialMLP``): ``mlp.router.weight``, ``mlp.experts.experts.linear_fc1.weight`` ([gate; up])
/ ``linear_fc2.weight`` with a leading expert axis (our ``local_experts.{e}`` is one slice of it),
``mlp.shared_experts.linear_fc1`` / ``linear_fc2`` / ``gate_weight``; per layer
(``WeightMapping.mcore_location``).
"""

from __future__ import annotations

from typing import Callable

from parallel_models.config import ModelConfig
from parallel_models.llama.checkpoint_utils.weight_rules import (FusedGateUp, Replicated, RowSplit)

# style -> (HF module of the MoE block, expert gate / up / down projection names)
_HF_STYLES = {
    "qwen": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}


def add_moe_mappings(config: ModelConfig, style: str, layer: Callable) -> None:
    """Add the MoE mappings through ``layer(ours, hf, mcore, rule, layers=, expert=)`` (the
    per-layer adder of ``llama_mappings``; names are relative to ``model.layers.{i}.``)."""
    if style not in _HF_STYLES:
        raise ValueError(f"unknown MoE naming style {style!r}; known: {', '.join(_HF_STYLES)}")
    block, (gate, up, down) = _HF_STYLES[style]
    layer("mlp.router.weight", (f"{block}.gate.weight",), "mlp.router.weight",
          Replicated("experts", "hidden"), layers="moe")
    for e in range(config.num_experts):
        hf = f"{block}.experts.{e}."
        ours = "mlp.experts.local_experts.{e}."
        layer(ours + "linear_fc1.weight", (hf + f"{gate}.weight", hf + f"{up}.weight"),
              "mlp.experts.experts.linear_fc1.weight", FusedGateUp(ffn="moe_ffn"),
              layers="moe", expert=e)
        layer(ours + "linear_fc2.weight", (hf + f"{down}.weight",),
              "mlp.experts.experts.linear_fc2.weight", RowSplit("hidden", "moe_ffn"),
              layers="moe", expert=e)
    if config.shared_expert_intermediate_size:
        hf = f"{block}.shared_expert."
        layer("mlp.shared_experts.linear_fc1.weight",
              (hf + f"{gate}.weight", hf + f"{up}.weight"),
              "mlp.shared_experts.linear_fc1.weight", FusedGateUp(ffn="shared_ffn"), layers="moe")
        layer("mlp.shared_experts.linear_fc2.weight", (hf + f"{down}.weight",),
              "mlp.shared_experts.linear_fc2.weight", RowSplit("hidden", "shared_ffn"),
              layers="moe")
        if config.shared_expert_gate:
            layer("mlp.shared_experts.gate_weight", (f"{block}.shared_expert_gate.weight",),
                  "mlp.shared_experts.gate_weight", Replicated("one", "hidden"), layers="moe")
