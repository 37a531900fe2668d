"""Causal attention of one context-parallel rank's chunks over the whole packed batch.

Keys and values of all CP ranks are all-gathered (their backward reduce-scatters dK/dV,
``parallel_models.context_parallel``) and put back in global order; each local query chunk then
attends to the prefix of its sequence up to its own end, causally aligned at the bottom right
(query ``i`` of a chunk that starts at position ``p`` sees keys ``0 .. p + i``). Exact: the same
softmax over the same keys as the CP = 1 kernel. flash-attn's varlen kernel does it in one call
on the GPU (fp16/bf16; its causal mask is bottom-right aligned when queries are fewer than keys);
otherwise one ``scaled_dot_product_attention`` per chunk with torch's lower-right causal bias, on
4-D inputs (SDPA's fused kernels refuse 3-D ones: its math kernel would make the scores).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from parallel_models.context_parallel import ContextParallelShard
from parallel_models.llama.layers.attention_kernels import _flash_attn_varlen, available_backend


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               shard: ContextParallelShard, scale: float) -> torch.Tensor:
    """q ``[local, heads, d]``, k/v ``[local, kv_heads, d]`` (rotated) -> ``[local, heads, d]``."""
    keys, values = shard.gather_kv(k), shard.gather_kv(v)
    if available_backend(q.device, q.dtype) == "flash_attn":
        return _flash(q, keys, values, shard, scale)
    return _sdpa_blocks(q, keys, values, shard, scale)


def _flash(q, keys, values, shard, scale):
    blocks = shard.blocks
    index = torch.cat([torch.arange(b.k_start, b.k_start + b.k_length) for b in blocks])
    index = index.to(q.device)
    cu_q = torch.tensor([0] + [b.length for b in blocks]).cumsum(0)
    cu_k = torch.tensor([0] + [b.k_length for b in blocks]).cumsum(0)
    cu_q, cu_k = (t.to(device=q.device, dtype=torch.int32) for t in (cu_q, cu_k))
    return _flash_attn_varlen()(
        q, keys.index_select(0, index), values.index_select(0, index), cu_q, cu_k,
        max(b.length for b in blocks), max(b.k_length for b in blocks), softmax_scale=scale,
        causal=True)


def _sdpa_blocks(q, keys, values, shard, scale):
    rep = q.shape[1] // keys.shape[1]
    outs = []
    for b in shard.blocks:
        # [1, heads, tokens, d]: SDPA's fused kernels (flash, memory-efficient) take only 4-D
        # inputs; 3-D ones run its math kernel, which makes the [heads, length, k_length]
        # scores (float32 on CUDA: 32 GiB per layer for an 8k chunk of a 32k sequence at 32
        # heads) and the mask
        qs = q[b.q_start:b.q_start + b.length].transpose(0, 1).unsqueeze(0)
        ks = keys[b.k_start:b.k_start + b.k_length].transpose(0, 1).unsqueeze(0)
        vs = values[b.k_start:b.k_start + b.k_length].transpose(0, 1).unsqueeze(0)
        if rep > 1:
            ks = ks.repeat_interleave(rep, dim=1)
            vs = vs.repeat_interleave(rep, dim=1)
        # query i of the chunk sits at position k_length - length + i: causal, bottom right
        # (torch's CausalBias: the flash kernel on the GPU, no mask materialized there)
        mask = causal_lower_right(b.length, b.k_length)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        outs.append(o.squeeze(0).transpose(0, 1))
    if not outs:
        return q.new_empty(q.shape)
    return torch.cat(outs, dim=0)
