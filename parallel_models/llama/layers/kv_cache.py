"""KV cache for incremental decoding of packed batches (one row per sequence, this rank's heads).

Prefill takes packed prompt tokens (``cu_seqlens``), runs the usual varlen causal attention and
stores each sequence's k/v at positions ``0..len-1`` of its row. Decode takes one new token per
sequence, stores it at position ``length`` and attends over the row's first ``length + 1``
entries. Rows are independent, so prompts of different lengths need no padding inside the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel_models.llama.layers.attention_kernels import varlen_causal_attention


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, max_length: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_layers, batch_size, max_length, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_length = max_length
        self._write_index = None  # (row, position) of each token of the current forward
        self.decoding = False

    def begin_prefill(self, cu_seqlens: torch.Tensor) -> None:
        counts = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        if int((self.lengths + counts).max()) > self.max_length:
            raise ValueError(f"KV cache of {self.max_length} positions is too small")
        rows = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), counts)
        pos = torch.arange(int(cu_seqlens[-1]), device=counts.device) - starts + self.lengths[rows]
        self._write_index = (rows, pos)
        self._new = counts
        self.decoding = False

    def begin_decode(self) -> None:
        """One token for every row."""
        if int(self.lengths.max()) >= self.max_length:
            raise ValueError(f"KV cache of {self.max_length} positions is full")
        rows = torch.arange(self.lengths.numel(), device=self.lengths.device)
        self._write_index = (rows, self.lengths.clone())
        self._new = torch.ones_like(self.lengths)
        self.decoding = True

    def end_step(self) -> None:
        self.lengths += self._new
        self._write_index = None

    def attend(self, layer: int, q, k, v, cu_seqlens, max_seqlen, scale):
        rows, pos = self._write_index
        self.k[layer, rows, pos] = k
        self.v[layer, rows, pos] = v
        if not self.decoding:  # prefill of fresh rows: plain causal attention on the prompt
            return varlen_causal_attention(q, k, v, cu_seqlens, max_seqlen, scale=scale)
        span = int(self.lengths.max()) + 1
        keys = self.k[layer, :, :span].transpose(1, 2)  # [B, kv, span, d]
        values = self.v[layer, :, :span].transpose(1, 2)
        rep = q.shape[1] // keys.shape[1]
        if rep > 1:
            keys = keys.repeat_interleave(rep, dim=1)
            values = values.repeat_interleave(rep, dim=1)
        valid = torch.arange(span, device=q.device)[None, :] <= self.lengths[:, None]  # [B, span]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values,
                                             attn_mask=valid[:, None, None, :], scale=scale)
        return out.squeeze(2)  # [B, heads, d]
