"""GQA self-attention: fused QKV column-parallel, optional per-head q/k RMSNorm (Qwen3), rotary,
varlen causal kernel, row-parallel out. Under context parallelism ``cu_seqlens`` is this rank's
:class:`~parallel_models.context_parallel.ContextParallelShard` and the keys of all CP ranks are
attended to (``layers/context_parallel.py``)."""

from __future__ import annotations

import torch
from megatron.core import ModelParallelConfig

from parallel_models.config import ModelConfig
from parallel_models.context_parallel import ContextParallelShard
from parallel_models.llama.layers.context_parallel import context_parallel_attention
from parallel_models.llama.layers import recompute
from parallel_models.llama.layers.attention_kernels import varlen_causal_attention
from parallel_models.llama.layers.linear import ParallelRowLinear, QKVParallelLinear
from parallel_models.llama.layers.fused_ops import rms_norm, rotary
from parallel_models.llama.layers.norm import RMSNorm


class ParallelAttention(torch.nn.Module):
    recompute_core_attention = False  # selective recomputation (layers/recompute.py)

    def __init__(self, config: ModelConfig, mp_config: ModelParallelConfig, layout=None):
        super().__init__()
        std = config.initializer_range
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, bias=config.qkv_bias, config=mp_config, init_std=std, layout=layout)
        self.o_proj = ParallelRowLinear(
            config.num_attention_heads * config.head_dim, config.hidden_size,
            bias=config.o_bias, config=mp_config, init_std=std, layout=layout)
        self.scale = config.head_dim ** -0.5
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            # One weight over head_dim shared by all heads (HF q_norm / k_norm). Each TP rank
            # holds other heads, so its weight gradient is partial: marked like a
            # sequence-parallel norm, and named as megatron-core names it, so our plain loop and
            # megatron's finalize_model_grads (config.qk_layernorm) both sum it over TP.
            partial = mp_config.tensor_model_parallel_size > 1
            device = "cpu" if mp_config.use_cpu_initialization else torch.cuda.current_device()
            kw = dict(sequence_parallel=partial, dtype=mp_config.params_dtype, device=device)
            self.q_layernorm = RMSNorm(config.head_dim, config.rms_norm_eps, **kw)
            self.k_layernorm = RMSNorm(config.head_dim, config.rms_norm_eps, **kw)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: torch.Tensor, max_seqlen: int, kv_cache=None,
                layer_index: int = 0) -> torch.Tensor:
        """hidden: [tokens(/tp under SP), 1, hidden] -> same shape."""
        qkv, _ = self.qkv_proj(hidden)  # gathers the sequence under SP: [tokens, 1, local]
        q, k, v = self.qkv_proj.split(qkv.squeeze(1))
        if self.qk_norm:  # [tokens, heads, head_dim], normed over head_dim before rotary
            q = rms_norm(q, self.q_layernorm.weight, self.q_layernorm.eps)
            k = rms_norm(k, self.k_layernorm.weight, self.k_layernorm.eps)
        if kv_cache is not None and getattr(kv_cache, "fuses_rope", bool)():
            # the cache's decode kernel rotates q and k itself (one kernel less per layer)
            out = kv_cache.attend(layer_index, q, k, v, cu_seqlens, max_seqlen, self.scale,
                                  rope=(cos, sin))
        elif kv_cache is not None:
            q, k = rotary(q, k, cos, sin)
            out = kv_cache.attend(layer_index, q, k, v, cu_seqlens, max_seqlen, self.scale)
        elif isinstance(cu_seqlens, ContextParallelShard):
            q, k = rotary(q, k, cos, sin)
            attend = recompute.context_parallel_core_attention if \
                self.recompute_core_attention else context_parallel_attention
            out = attend(q, k, v, cu_seqlens, scale=self.scale)
        else:
            q, k = rotary(q, k, cos, sin)
            attend = recompute.core_attention if self.recompute_core_attention else \
                varlen_causal_attention  # (selective recomputation)
            out = attend(q, k, v, cu_seqlens, max_seqlen, scale=self.scale)
        out, _ = self.o_proj(out.reshape(out.shape[0], 1, -1))
        return out
