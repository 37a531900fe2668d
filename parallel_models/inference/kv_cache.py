"""KV cache for incremental decoding of packed batches (one row per sequence, this rank's heads).

Prefill takes packed prompt tokens (``cu_seqlens``), runs the usual varlen causal attention and
stores each sequence's k/v at positions ``0..len-1`` of its row. Decode takes one new token per
sequence, stores it at position ``length`` and attends over the row's first ``length + 1``
entries. Rows are independent, so prompts of different lengths need no padding inside the cache.

A decode step makes no host synchronization and keeps every tensor address fixed (positions are
read from ``lengths`` in place), so it can be captured once in a CUDA graph and replayed
(parallel_models/inference/generation.py). On CUDA fp16/bf16 it runs PyTorch's flash kernel with
per-row key counts (``seqused_k``): it reads only the filled part of each row and the GQA KV
heads as they are (flash decoding); elsewhere SDPA over the filled span with a mask.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from parallel_models.llama.layers import exact
from parallel_models.llama.layers.attention_kernels import varlen_causal_attention


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, max_length: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_layers, batch_size, max_length, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_length = max_length
        self.filled = 0  # host-side max of ``lengths`` (decode needs no device read)
        self._rows = torch.arange(batch_size, device=device)
        self._write_index = None  # (row, position) of each token of the current forward
        self._new = None
        self._used = None  # int32 keys per row for the flash decode kernel
        self.decoding = False
        self.flash_decode = _flash_decode_supported(device, dtype)
        if self.flash_decode:  # rows of the cache as packed sequences of max_length slots
            self._cu_q = torch.arange(batch_size + 1, dtype=torch.int32, device=device)
            self._cu_k = self._cu_q * max_length

    def begin_prefill(self, cu_seqlens: torch.Tensor) -> None:
        counts = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        new_filled = int((self.lengths + counts).max())
        if new_filled > self.max_length:
            raise ValueError(f"KV cache of {self.max_length} positions is too small")
        rows = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), counts)
        pos = torch.arange(int(cu_seqlens[-1]), device=counts.device) - starts + self.lengths[rows]
        self._write_index = (rows, pos)
        self._new = counts
        self._filled_after = new_filled
        self.decoding = False

    def begin_decode(self) -> None:
        """One token for every row, at position ``lengths`` (read in place: graph-safe)."""
        if self.filled >= self.max_length:
            raise ValueError(f"KV cache of {self.max_length} positions is full")
        self._write_index = (self._rows, self.lengths)
        self._new = 1
        self._filled_after = self.filled + 1
        if self.flash_decode:
            self._used = (self.lengths + 1).to(torch.int32)
        self.decoding = True

    def end_step(self) -> None:
        self.lengths += self._new
        self.filled = self._filled_after
        self._write_index = None

    def attend(self, layer: int, q, k, v, cu_seqlens, max_seqlen, scale):
        rows, pos = self._write_index
        self.k[layer, rows, pos] = k
        self.v[layer, rows, pos] = v
        if not self.decoding:  # prefill of fresh rows: plain causal attention on the prompt
            return varlen_causal_attention(q, k, v, cu_seqlens, max_seqlen, scale=scale)
        if exact.enabled():  # the kernel of prefill and training (layers/exact)
            from parallel_models.llama.layers.exact import ops

            b, max_len, kv, d = self.k[layer].shape
            return ops.decode_attention(q, self.k[layer].view(b * max_len, kv, d),
                                        self.v[layer].view(b * max_len, kv, d),
                                        self._rows * max_len, self.lengths, scale)
        if self.flash_decode:
            return _flash_decode(q, self.k[layer], self.v[layer], self._cu_q, self._cu_k,
                                 self._used, scale)
        return _sdpa_decode(q, self.k[layer], self.v[layer], self.lengths, self.filled + 1, scale)


def _flash_decode(q, k_rows, v_rows, cu_q, cu_k, used, scale):
    """q ``[B, heads, d]``; k/v rows ``[B, max_len, kv_heads, d]`` of which ``used`` are valid."""
    b, max_len, kv, d = k_rows.shape
    out = torch.ops.aten._flash_attention_forward(
        q, k_rows.view(b * max_len, kv, d), v_rows.view(b * max_len, kv, d), cu_q, cu_k, 1,
        max_len, 0.0, False, False, scale=scale, seqused_k=used)
    return out[0]


def _sdpa_decode(q, k_rows, v_rows, lengths, span, scale):
    """Masked SDPA over the first ``span`` positions. GQA without copying K/V: the query heads
    that share a KV head become that head's query rows ([B, kv, rep, d])."""
    b, heads, d = q.shape
    kv = k_rows.shape[2]
    keys = k_rows[:, :span].transpose(1, 2)  # [B, kv, span, d]
    values = v_rows[:, :span].transpose(1, 2)
    valid = torch.arange(span, device=q.device)[None, :] <= lengths[:, None]  # [B, span]
    out = F.scaled_dot_product_attention(q.view(b, kv, heads // kv, d), keys, values,
                                         attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(b, heads, d)


@functools.cache
def _flash_decode_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """PyTorch's flash kernel with ``seqused_k`` (CUDA, fp16/bf16), checked once against SDPA."""
    if torch.device(device).type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        b, max_len, heads, kv, d = 3, 16, 4, 2, 64
        q = torch.randn(b, heads, d, device=device, dtype=dtype, generator=g)
        k = torch.randn(b, max_len, kv, d, device=device, dtype=dtype, generator=g)
        v = torch.randn(b, max_len, kv, d, device=device, dtype=dtype, generator=g)
        lengths = torch.tensor([0, 7, 15], device=device)
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=device)
        got = _flash_decode(q, k, v, cu_q, cu_q * max_len, (lengths + 1).int(), None)
        want = _sdpa_decode(q, k, v, lengths, max_len, None)
        return bool(torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2))
    except Exception:  # op or argument missing in this torch build
        return False
