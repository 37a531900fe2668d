"""Gated MLP (SwiGLU, or GELU-tanh for Gemma: ``config.hidden_act``): fused gate-up
column-parallel, down row-parallel."""

from __future__ import annotations

import torch
from megatron.core import ModelParallelConfig

from parallel_models.config import ModelConfig
from parallel_models.llama.layers.fused_ops import gated_mlp_input
from parallel_models.llama.layers.linear import GateUpParallelLinear, ParallelRowLinear


class ParallelMLP(torch.nn.Module):
    def __init__(self, config: ModelConfig, mp_config: ModelParallelConfig, layout=None):
        super().__init__()
        std = config.initializer_range
        self.hidden_act = config.hidden_act
        self.gate_up_proj = GateUpParallelLinear(config.hidden_size, config.intermediate_size,
                                                 bias=config.mlp_bias, config=mp_config,
                                                 init_std=std, layout=layout)
        self.down_proj = ParallelRowLinear(config.intermediate_size, config.hidden_size,
                                           bias=config.mlp_bias, config=mp_config, init_std=std,
                                           layout=layout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out, _ = self.down_proj(gated_mlp_input(self.gate_up_proj, hidden, self.hidden_act))
        return out
