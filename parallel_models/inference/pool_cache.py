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

``kv_cache_dtype="fp8"`` (``rollout.kv_cache_dtype``; vLLM's ``kv_cache_dtype=fp8``): K and V
are stored in e4m3 with one fp32 scale per (position, KV head) (``k_scale`` / ``v_scale``, the
pool's shape minus head_dim): ``scale = amax / 448`` over the head_dim values (1 for all-zero),
computed whenever an entry is written (prefill, extension, decode: :meth:`PoolKVCache.store`),
dequantized as ``e4m3 * scale`` by every read (the SDPA gathers, :meth:`PoolKVCache.gather`;
the split-KV kernel per key entry). Half the KV bytes per decode step, twice the tokens per
budget (``memory_plan``). Prefill attention runs on the step's unquantized k / v, and the
split-KV kernel attends to the step's own new entries unquantized too (the PyTorch decode paths
read them back from the pool); PyTorch's flash kernel takes no e4m3, so on CUDA an fp8 pool
decodes through the split-KV kernel (or SDPA, not graph-captured, without triton). The default
(``"bf16"``: the model's dtype) is the pool as it always was.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel_models.llama.layers import exact
from parallel_models.llama.layers.attention_kernels import varlen_causal_attention
from parallel_models.inference import split_kv_attention
from parallel_models.options import option
from parallel_models.inference.kv_cache import _flash_decode_supported
from parallel_models.inference.kv_quant import check_kv_cache_dtype, dequantize_kv, quantize_kv
from parallel_models.inference.split_kv_attention import split_kv_decode

def _decode_kernel(device: torch.device, dtype: torch.dtype, heads_dim: tuple,
                   fp8: bool = False) -> str:
    """``"triton"`` (split-KV, ``split_kv_attention``) on CUDA fp16/bf16 when triton imports and
    the kernel passes its check against SDPA on this device, else ``"aten"`` (PyTorch's
    kernels); the option ``decode_attention`` = ``"aten"`` forces PyTorch's (the bench
    compares). Graph capture of decode steps needs either of the CUDA ones."""
    choice = option("decode_attention")  # "triton" | "aten" (validated there)
    if choice == "triton" and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) \
            and split_kv_attention.supported(device, dtype, *heads_dim) \
            and (not fp8 or split_kv_attention.supported(device, dtype, *heads_dim, fp8_kv=True)):
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
    """K / V ``[layers, capacity + max_rows, kv_heads, head_dim]`` in ``dtype`` (the model's,
    what reads return), or e4m3 with ``k_scale`` / ``v_scale`` ``[layers, positions, kv_heads]``
    for ``kv_cache_dtype="fp8"`` (see the module docstring)."""

    def __init__(self, num_layers: int, capacity: int, max_rows: int, max_row_tokens: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                 kv_cache_dtype: str = "bf16"):
        check_kv_cache_dtype(kv_cache_dtype)
        self.capacity, self.max_rows, self.max_row_tokens = capacity, max_rows, max_row_tokens
        self.end = capacity + max_rows  # scratch positions of the padding rows at the end
        self.dtype, self.fp8 = dtype, kv_cache_dtype == "fp8"
        shape = (num_layers, self.end, num_kv_heads, head_dim)
        stored = torch.float8_e4m3fn if self.fp8 else dtype
        self.k = torch.zeros(shape, dtype=stored, device=device)
        self.v = torch.zeros(shape, dtype=stored, device=device)
        self.k_scale = self.v_scale = None
        if self.fp8:
            self.k_scale = torch.ones(shape[:-1], dtype=torch.float32, device=device)
            self.v_scale = torch.ones(shape[:-1], dtype=torch.float32, device=device)
        # PyTorch's flash kernel reads no e4m3: an fp8 pool decodes through the split-KV kernel
        self.flash_decode = not self.fp8 and _flash_decode_supported(torch.device(device), dtype)
        self.decode_kernel = _decode_kernel(torch.device(device), dtype, (num_kv_heads, head_dim),
                                            self.fp8)
        self._heads_dim = (num_kv_heads, head_dim)
        if self.decode_kernel == "triton":  # its one-off check now, before any graph capture
            split_kv_attention.rope_supported(self.k.device, dtype, *self._heads_dim)
        self._write = None
        self._rows: DecodeRows | None = None
        self.decoding = False

    @property
    def graph_safe(self) -> bool:
        """The decode step can be captured in a CUDA graph: PyTorch's flash kernel, or (an fp8
        pool) the split-KV kernel."""
        return self.flash_decode or (self.fp8 and self.decode_kernel == "triton")

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
            and split_kv_attention.rope_supported(self.k.device, self.dtype, *self._heads_dim)

    def attend(self, layer: int, q, k, v, cu_seqlens, max_seqlen, scale, rope=None):
        if rope is not None and not self.fuses_rope():
            raise ValueError("rope=(cos, sin) given to a step that does not fuse it")
        if not self.decoding:
            self.write_kv(layer, k, v)
            return varlen_causal_attention(q, k, v, cu_seqlens, max_seqlen, scale=scale)
        if self.decode_kernel == "triton" and not exact.enabled():  # writes k / v itself
            rows = self._rows
            scales = (self.k_scale[layer], self.v_scale[layer]) if self.fp8 else None
            return split_kv_decode(q, k, v, self.k[layer], self.v[layer], rows.offsets,
                                   rows.used, self.max_row_tokens, scale, rope=rope,
                                   back=rows.back, kv_scales=scales)
        self.write_kv(layer, k, v)
        return self.decode_attention(layer, q, scale)

    def write_kv(self, layer: int, k, v) -> None:
        """The step's new k / v at their pool positions."""
        self.store(layer, self._write, k, v)

    def store(self, layer: int, index: torch.Tensor, k, v) -> None:
        """``k`` / ``v`` ``[n, kv_heads, d]`` (model dtype) at pool positions ``index`` of
        ``layer`` (fp8: quantized, their scales beside)."""
        if self.fp8:
            k, k_scale = quantize_kv(k)
            v, v_scale = quantize_kv(v)
            self.k_scale[layer].index_copy_(0, index, k_scale)
            self.v_scale[layer].index_copy_(0, index, v_scale)
            # (as bytes: PyTorch's CPU index_copy_ / indexing take no e4m3)
            self.k[layer].view(torch.uint8).index_copy_(0, index, k.view(torch.uint8))
            self.v[layer].view(torch.uint8).index_copy_(0, index, v.view(torch.uint8))
            return
        self.k[layer].index_copy_(0, index, k)
        self.v[layer].index_copy_(0, index, v)

    def gather(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at pool positions ``index`` (any shape) of ``layer``, in the model dtype
        (fp8: dequantized) -> ``[*index.shape, kv_heads, d]`` each."""
        if not self.fp8:
            return self.k[layer][index], self.v[layer][index]
        k = self.k[layer].view(torch.uint8)[index].view(self.k.dtype)
        v = self.v[layer].view(torch.uint8)[index].view(self.v.dtype)
        return (dequantize_kv(k, self.k_scale[layer][index], self.dtype),
                dequantize_kv(v, self.v_scale[layer][index], self.dtype))

    def decode_attention(self, layer: int, q, scale):
        """PyTorch's kernels: flash with ``seqused_k`` on CUDA fp16/bf16, else masked SDPA (exact
        mode: the attention kernel of prefill and training, ``layers/exact``)."""
        rows = self._rows
        if exact.enabled():  # the kernel of prefill and training (layers/exact)
            if self.fp8:
                raise ValueError("exact mode reads the KV pool in the model's dtype: "
                                 "kv_cache_dtype=fp8 cannot go with it")
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
        keys, values = self.gather(layer, index)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, kv, span, d]
        kv = keys.shape[1]
        valid = window[None, :] <= rows.lengths[:, None]
        out = F.scaled_dot_product_attention(q.view(b, kv, heads // kv, d), keys, values,
                                             attn_mask=valid[:, None, None, :], scale=scale)
        return out.reshape(b, heads, d)

    def _stored(self) -> tuple[torch.Tensor, ...]:
        """The pool's tensors, position on dim 1 (k, v; fp8: and their scales)."""
        return (self.k, self.v) + ((self.k_scale, self.v_scale) if self.fp8 else ())

    def copy(self, src: int, dsts: list[int], length: int) -> None:
        """Copy positions ``src .. src+length`` of every layer to each start in ``dsts``."""
        for dst in dsts:
            for t in self._stored():
                t[:, dst:dst + length].copy_(t[:, src:src + length])

    def read(self, start: int, length: int) -> tuple:
        """Copies of a region's first ``length`` positions: ``(k, v)`` ``[layers, length, kv,
        d]`` each (fp8: each a ``(e4m3, scales)`` pair), what :meth:`write` takes."""
        got = [t[:, start:start + length].clone() for t in self._stored()]
        return (got[0], got[1]) if not self.fp8 else ((got[0], got[2]), (got[1], got[3]))

    def write(self, start: int, k, v) -> None:
        """Put a :meth:`read` of a region at ``start``."""
        parts = (k, v) if not self.fp8 else (k[0], v[0], k[1], v[1])
        for t, part in zip(self._stored(), parts):
            t[:, start:start + part.shape[1]].copy_(part)


__all__ = ["DecodeRows", "PoolKVCache"]
