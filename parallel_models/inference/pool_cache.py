"""KV cache of the continuous-batching engine: one flat pool of token positions per layer.

Each running sample owns a contiguous region of the pool (``scheduler.Scheduler`` places it), so
its KV stays where it was written until the sample finishes, whatever joins or leaves the batch.
Behind the ``capacity`` positions sit ``max_rows`` scratch positions: padding rows of a decode
bucket write and read there (one position each), so a bucket of fixed size needs no masking.

- Prefill (``begin_prefill``): packed prompts, sequence i written at ``offsets[i] + 0..len-1``;
  attention is the usual varlen causal kernel on the new tokens.
- Decode (``begin_decode`` with a :class:`DecodeRows`): one token per entry, written at
  ``offset + length``; attention over the entry's ``length + 1`` positions (a re-entering row
  fed several tokens in one step is several entries of one region, ``decode_layout``: every
  path below writes all entries' k / v before any of them is read, the split-KV kernel by
  reading a row's earlier entries from the step's new k / v). On CUDA fp16/bf16 it is
  PyTorch's flash kernel with ``cu_seqlens_k`` = the region starts and ``seqused_k`` = the
  lengths (flash decoding straight from the pool, GQA heads as they are); elsewhere SDPA over a
  gathered ``[rows, span]`` window with a mask. With triton on CUDA fp16/bf16 (default; the
  option ``decode_attention: aten``, env ``PARALLEL_MODELS_DECODE_ATTENTION=aten``, switches it
  off) the decode step's KV write and attention are one split-KV kernel instead
  (``split_kv_attention``: each KV byte read once under GQA, the work split along the context;
  the rotary embedding of q and the new k too: :meth:`PoolKVCache.fuses_rope`, the option
  ``decode_fuse_rope`` off, ``PARALLEL_MODELS_DECODE_FUSE_ROPE=0``, switches that off).
  A decode step reads every index from the fixed
  buffers of its :class:`DecodeRows`, so it can be captured once per bucket in a CUDA graph.
- ``copy`` duplicates a prompt's KV into other regions (prefix sharing of the n samples).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel_models.llama.layers import exact
from parallel_models.llama.layers.attention_kernels import varlen_causal_attention
from parallel_models.inference import split_kv_attention
from parallel_models.options import option
from parallel_models.inference.kv_cache import _flash_decode_supported
from parallel_models.inference.split_kv_attention import split_kv_decode

def _decode_kernel(device: torch.device, dtype: torch.dtype, heads_dim: tuple) -> str:
    """``"triton"`` (split-KV, ``split_kv_attention``) on CUDA fp16/bf16 when triton imports and
    the kernel passes its check against SDPA on this device, else ``"aten"`` (PyTorch's
    kernels); the option ``decode_attention`` = ``"aten"`` forces PyTorch's (the bench
    compares). Graph capture of decode steps needs either of the CUDA ones."""
    choice = option("decode_attention")  # "triton" | "aten" (validated there)
    if choice == "triton" and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) \
            and split_kv_attention.supported(device, dtype, *heads_dim):
        return "triton"
    return "aten"


class DecodeRows:
    """The fixed input buffers of one decode bucket of ``size`` rows (addresses never change)."""

    def __init__(self, size: int, device, pool_end: int):
        self.size = size
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)
        self.offsets = torch.zeros(size, dtype=torch.long, device=device)
        self.lengths = torch.zeros(size, dtype=torch.long, device=device)  # = the positions
        self.write = torch.zeros(size, dtype=torch.long, device=device)
        self.used = torch.ones(size, dtype=torch.int32, device=device)
        # entries of the same row before this one in the step (a fed re-entry; decode_layout)
        self.back = torch.zeros(size, dtype=torch.int32, device=device)
        self.cu_q = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.cu_k = torch.full((size + 1,), pool_end, dtype=torch.int32, device=device)
        self.span = 1  # host: max(lengths) + 1 (the SDPA path's window)

    def load(self, packed: torch.Tensor, span: int) -> None:
        """``packed``: ``[4, size]`` (tokens, offsets, lengths, back) on the device; offsets
        ascending."""
        self.tokens.copy_(packed[0])
        self.offsets.copy_(packed[1])
        self.lengths.copy_(packed[2])
        self.back.copy_(packed[3])
        self.cu_k[:-1].copy_(packed[1])
        self.span = span


class PoolKVCache:
    def __init__(self, num_layers: int, capacity: int, max_rows: int, max_row_tokens: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device):
        self.capacity, self.max_rows, self.max_row_tokens = capacity, max_rows, max_row_tokens
        self.end = capacity + max_rows  # scratch positions of the padding rows at the end
        shape = (num_layers, self.end, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.flash_decode = _flash_decode_supported(torch.device(device), dtype)
        self.decode_kernel = _decode_kernel(torch.device(device), dtype, (num_kv_heads, head_dim))
        self._heads_dim = (num_kv_heads, head_dim)
        if self.decode_kernel == "triton":  # its one-off check now, before any graph capture
            split_kv_attention.rope_supported(self.k.device, dtype, *self._heads_dim)
        self._write = None
        self._rows: DecodeRows | None = None
        self.decoding = False

    def scratch(self, i: int) -> int:
        """Region start of padding row ``i`` (one position, never part of a real region)."""
        return self.capacity + i

    def begin_prefill(self, offsets: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
        counts = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), counts)
        pos = torch.arange(int(cu_seqlens[-1]), device=counts.device) - starts
        self._write = torch.repeat_interleave(offsets.long(), counts) + pos
        self.decoding = False

    def begin_decode(self, rows: DecodeRows) -> None:
        """Graph-safe: every index is computed on the device from ``rows``' buffers."""
        torch.add(rows.offsets, rows.lengths, out=rows.write)
        rows.used.copy_(rows.lengths + 1)
        self._write, self._rows = rows.write, rows
        self.decoding = True

    def end_step(self) -> None:
        self._write = None

    def fuses_rope(self) -> bool:
        """True when this step's :meth:`attend` takes q / k unrotated with ``rope=(cos, sin)``
        (decode through the split-KV kernel, which rotates them; the attention module then
        skips its rotary kernel). Never in exact mode (its decode kernel is the one of prefill
        and training, which takes rotated q / k) nor with the option ``decode_fuse_rope`` off."""
        return self.decoding and self.decode_kernel == "triton" and not exact.enabled() \
            and option("decode_fuse_rope") \
            and split_kv_attention.rope_supported(self.k.device, self.k.dtype, *self._heads_dim)

    def attend(self, layer: int, q, k, v, cu_seqlens, max_seqlen, scale, rope=None):
        if rope is not None and not self.fuses_rope():
            raise ValueError("rope=(cos, sin) given to a step that does not fuse it")
        if not self.decoding:
            self.write_kv(layer, k, v)
            return varlen_causal_attention(q, k, v, cu_seqlens, max_seqlen, scale=scale)
        if self.decode_kernel == "triton" and not exact.enabled():  # writes k / v itself
            rows = self._rows
            return split_kv_decode(q, k, v, self.k[layer], self.v[layer], rows.offsets,
                                   rows.used, self.max_row_tokens, scale, rope=rope,
                                   back=rows.back)
        self.write_kv(layer, k, v)
        return self.decode_attention(layer, q, scale)

    def write_kv(self, layer: int, k, v) -> None:
        """The step's new k / v at their pool positions."""
        self.k[layer].index_copy_(0, self._write, k)
        self.v[layer].index_copy_(0, self._write, v)

    def decode_attention(self, layer: int, q, scale):
        """PyTorch's kernels: flash with ``seqused_k`` on CUDA fp16/bf16, else masked SDPA (exact
        mode: the attention kernel of prefill and training, ``layers/exact``)."""
        rows = self._rows
        if exact.enabled():  # the kernel of prefill and training (layers/exact)
            from parallel_models.llama.layers.exact import ops

            return ops.decode_attention(q, self.k[layer], self.v[layer], rows.offsets,
                                        rows.lengths, scale)
        if self.flash_decode:
            out = torch.ops.aten._flash_attention_forward(
                q, self.k[layer], self.v[layer], rows.cu_q, rows.cu_k, 1, self.max_row_tokens,
                0.0, False, False, scale=scale, seqused_k=rows.used)
            return out[0]
        return self._sdpa_decode(layer, q, rows, scale)

    def _sdpa_decode(self, layer, q, rows: DecodeRows, scale):
        """Masked SDPA over a gathered window of each row; GQA without repeating K/V (the query
        heads sharing a KV head become that head's query rows)."""
        b, heads, d = q.shape
        span = rows.span
        window = torch.arange(span, device=q.device)
        index = (rows.offsets[:, None] + window[None, :]).clamp_(max=self.end - 1)  # [B, span]
        keys = self.k[layer][index].transpose(1, 2)  # [B, kv, span, d]
        values = self.v[layer][index].transpose(1, 2)
        kv = keys.shape[1]
        valid = window[None, :] <= rows.lengths[:, None]
        out = F.scaled_dot_product_attention(q.view(b, kv, heads // kv, d), keys, values,
                                             attn_mask=valid[:, None, None, :], scale=scale)
        return out.reshape(b, heads, d)

    def copy(self, src: int, dsts: list[int], length: int) -> None:
        """Copy positions ``src .. src+length`` of every layer to each start in ``dsts``."""
        for dst in dsts:
            self.k[:, dst:dst + length].copy_(self.k[:, src:src + length])
            self.v[:, dst:dst + length].copy_(self.v[:, src:src + length])

    def read(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of a region's first ``length`` positions (``[layers, length, kv, d]`` each)."""
        return (self.k[:, start:start + length].clone(), self.v[:, start:start + length].clone())

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[:, start:start + k.shape[1]].copy_(k)
        self.v[:, start:start + v.shape[1]].copy_(v)


__all__ = ["DecodeRows", "PoolKVCache"]
