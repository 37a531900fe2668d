"""GQA self-attention: fused QKV column-parallel, rotary, varlen causal kernel, row-parallel out."""

from __future__ import annotations

import torch
from megatron.core import ModelParallelConfig

from parallel_models.config import ModelConfig
from parallel_models.llama.layers.attention_kernels import varlen_causal_attention
from parallel_models.llama.layers.linear import ParallelRowLinear, QKVParallelLinear
from parallel_models.llama.layers.fused_ops import rotary


class ParallelAttention(torch.nn.Module):
    def __init__(self, config: ModelConfig, mp_config: ModelParallelConfig):
        super().__init__()
        std = config.initializer_range
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, bias=config.qkv_bias, config=mp_config, init_std=std)
        self.o_proj = ParallelRowLinear(
            config.num_attention_heads * config.head_dim, config.hidden_size,
            bias=config.o_bias, config=mp_config, init_std=std)
        self.scale = config.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: torch.Tensor, max_seqlen: int, kv_cache=None,
                layer_index: int = 0) -> torch.Tensor:
        """hidden: [tokens(/tp under SP), 1, hidden] -> same shape."""
        qkv, _ = self.qkv_proj(hidden)  # gathers the sequence under SP: [tokens, 1, local]
        q, k, v = self.qkv_proj.split(qkv.squeeze(1))
        q, k = rotary(q, k, cos, sin)
        if kv_cache is not None:
            out = kv_cache.attend(layer_index, q, k, v, cu_seqlens, max_seqlen, self.scale)
        else:
            out = varlen_causal_attention(q, k, v, cu_seqlens, max_seqlen, scale=self.scale)
        out, _ = self.o_proj(out.reshape(out.shape[0], 1, -1))
        return out
