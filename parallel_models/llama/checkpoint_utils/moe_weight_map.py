"""The MoE part of the weight map: router, routed experts and the shared expert (with its gate) of
Qwen3-MoE, Qwen2-MoE and Mixtral, as HF names, our parameter names and megatron-core keys.

Called by ``weight_map.llama_mappings`` for a config with MoE layers; the mappings it adds apply
to the MoE layers only (``layers="moe"``), and each routed-expert mapping names one global expert
(``expert=e``): our parameter is ``local_experts.{e}`` with ``e`` the index within this rank's
experts (expert parallel), filled in by whoever builds the parameter name.

HF names (as ``save_pretrained`` of transformers 5 writes them, one tensor per expert) come from
the family's ``moe_hf_names`` (``parallel_models.llama.families``): ``(block, (gate, up, down))``
gives ``{block}.gate.weight`` (router), ``{block}.experts.{e}.{gate}.weight`` ... and, with a
shared expert, ``{block}.shared_expert.{gate,up,down}.weight`` and ``{block}.shared_expert_gate``;
e.g. Qwen2-MoE / Qwen3-MoE ``("mlp", ("gate_proj", "up_proj", "down_proj"))``, Mixtral
``("block_sparse_moe", ("w1", "w3", "w2"))``.
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

# the HF names of a family that declares none (Qwen's): (MoE block module, gate / up / down)
DEFAULT_MOE_HF_NAMES = ("mlp", ("gate_proj", "up_proj", "down_proj"))


def add_moe_mappings(config: ModelConfig, hf_names: tuple[str, tuple[str, str, str]],
                     layer: Callable) -> None:
    """Add the MoE mappings through ``layer(ours, hf, mcore, rule, layers=, expert=)`` (the
    per-layer adder of ``llama_mappings``; names are relative to ``model.layers.{i}.``);
    ``hf_names``: (HF module of the MoE block, its experts' gate / up / down names)."""
    block, (gate, up, down) = hf_names
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
