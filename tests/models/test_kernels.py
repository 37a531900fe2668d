"""Attention kernels and the KV cache's decode attention, on the CPU (fp32), against plain
per-sequence / repeated-KV references. (The CUDA-only kernels are checked by bench/ on a GPU.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel_models.llama.layers import attention_kernels as ak
from parallel_models.llama.layers import fused_ops
from parallel_models.inference.kv_cache import KVCache, _flash_decode_supported, _sdpa_decode


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_batched_sdpa_equals_per_sequence_with_gqa():
    torch.manual_seed(0)
    n, s, h, kv, d = 3, 17, 8, 2, 16
    q = torch.randn(n * s, h, d)
    k = torch.randn(n * s, kv, d)
    v = torch.randn(n * s, kv, d)
    cu = torch.arange(0, n * s + 1, s, dtype=torch.int32)
    got = ak._sdpa_batched(q, k, v, n, 0.3)
    want = ak._sdpa_per_sequence(q, k, v, cu, 0.3)
    assert got.shape == want.shape
    assert _rel(got, want) < 1e-6


def _naive_decode(q, k_rows, v_rows, lengths, scale):
    out = []
    rep = q.shape[1] // k_rows.shape[2]
    for b, n in enumerate(lengths.tolist()):
        keys = k_rows[b, : n + 1].transpose(0, 1).repeat_interleave(rep, 0)  # [h, n+1, d]
        values = v_rows[b, : n + 1].transpose(0, 1).repeat_interleave(rep, 0)
        out.append(F.scaled_dot_product_attention(q[b][:, None], keys, values, scale=scale)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("heads,kv", [(4, 4), (8, 2), (6, 1)])
def test_decode_attention_reads_gqa_heads_without_copies(heads, kv):
    torch.manual_seed(1)
    b, max_len, d = 4, 12, 8
    q = torch.randn(b, heads, d)
    k_rows = torch.randn(b, max_len, kv, d)
    v_rows = torch.randn(b, max_len, kv, d)
    lengths = torch.tensor([0, 3, 11, 7])
    got = _sdpa_decode(q, k_rows, v_rows, lengths, int(lengths.max()) + 1, 0.5)
    assert _rel(got, _naive_decode(q, k_rows, v_rows, lengths, 0.5)) < 1e-6


def test_kv_cache_tracks_fill_on_the_host_and_refuses_overflow():
    cache = KVCache(1, 2, 5, 1, 4, torch.float32, torch.device("cpu"))
    assert not cache.flash_decode and not _flash_decode_supported(torch.device("cpu"), torch.float32)
    cache.begin_prefill(torch.tensor([0, 3, 4], dtype=torch.int32))
    cache.end_step()
    assert cache.filled == 3 and cache.lengths.tolist() == [3, 1]
    for _ in range(2):
        cache.begin_decode()
        cache.end_step()
    assert cache.filled == 5 and cache.lengths.tolist() == [5, 3]
    with pytest.raises(ValueError, match="full"):
        cache.begin_decode()


def test_fused_ops_compute_the_transformers_math_on_cpu():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(2)
    x, r = torch.randn(5, 1, 32), torch.randn(5, 1, 32)
    norm = LlamaRMSNorm(32, eps=1e-5)
    norm.weight.data.normal_()
    total, normed = fused_ops.add_rms_norm(x, r, norm.weight, 1e-5)
    assert torch.equal(total, x + r)
    assert torch.equal(normed, norm(x + r))
    gate_up = torch.randn(5, 1, 64)
    assert torch.equal(fused_ops.swiglu(gate_up), F.silu(gate_up[..., :32]) * gate_up[..., 32:])
