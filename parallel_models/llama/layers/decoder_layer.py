"""Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x)); the MLP is the dense SwiGLU
one, or megatron-core's MoE layer on the layers ``config.moe_layer_ids`` lists."""

from __future__ import annotations

import torch
from megatron.core import ModelParallelConfig

from parallel_models.config import ModelConfig
from parallel_models.llama.layers.attention import ParallelAttention
from parallel_models.llama.layers.fused_ops import add_rms_norm
from parallel_models.llama.layers.mlp import ParallelMLP
from parallel_models.llama.layers.moe import ParallelMoE
from parallel_models.llama.layers.norm import RMSNorm


class ParallelDecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, mp_config: ModelParallelConfig, layer_id: int,
                 layout=None):
        super().__init__()
        self.layer_id = layer_id  # global index (differs from the local one under PP)
        sp = mp_config.sequence_parallel
        kw = dict(sequence_parallel=sp, dtype=mp_config.params_dtype,
                  device=_param_device(mp_config), unit_offset=config.norm_unit_offset)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.self_attn = ParallelAttention(config, mp_config, layout)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.mlp = (ParallelMoE(config, mp_config, layer_id, layout)
                    if config.is_moe_layer(layer_id) else ParallelMLP(config, mp_config, layout))

    def forward(self, hidden, cos, sin, cu_seqlens, max_seqlen, kv_cache=None, layer_index=0):
        residual, mlp_out = self.forward_parts(hidden, self.input_layernorm(hidden), cos, sin,
                                               cu_seqlens, max_seqlen, kv_cache, layer_index)
        return residual + mlp_out

    def forward_parts(self, hidden, normed, cos, sin, cu_seqlens, max_seqlen, kv_cache=None,
                      layer_index=0):
        """The layer on ``hidden`` whose input norm ``normed`` is given -> ``(residual, mlp
        output)``, not yet summed: a caller can fuse that sum with the next layer's input norm
        (``ParallelDecoder`` does when decoding with a KV cache)."""
        attn = self.self_attn(normed, cos, sin, cu_seqlens, max_seqlen, kv_cache, layer_index)
        norm = self.post_attention_layernorm
        hidden, normed = add_rms_norm(attn, hidden, norm.weight, norm.eps,  # one fused pass
                                      norm.unit_offset)
        return hidden, self.mlp(normed)


def _param_device(mp_config: ModelParallelConfig):
    return "cpu" if mp_config.use_cpu_initialization else torch.cuda.current_device()
