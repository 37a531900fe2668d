"""Exact mode's Triton kernels (``parallel_models/llama/layers/exact``) on the CPU interpreter:
each kernel against the PyTorch op it replaces (tolerances), and the batch invariance that makes
exact mode exact, shown structurally: a row computed alone, or at another place among other rows,
gives the same bits; a decode query equals the same query inside a packed prefill. (Bitwise
claims about the GPU's reductions are proven by tests/gpu/test_exact_mode.py.)

Skipped when Triton is not importable (it is not a dependency). Without CUDA the interpreter is
switched on here, before Triton is first imported.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=_g(seed)).to(device=DEV, dtype=dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matmuls_match_torch(dtype, tol):
    from parallel_models.llama.layers.exact import triton_matmul as tm

    a, w = _randn(37, 48, seed=1, dtype=dtype), _randn(40, 48, seed=2, dtype=dtype)
    ref = a.double() @ w.double().t()
    got = tm.matmul(a, w.t())  # a transposed (strided) right operand, as in F.linear
    assert got.dtype == dtype and got.shape == (37, 40)
    assert ((got.double() - ref).abs() / (ref.abs() + 1)).max() <= tol
    counts = [5, 0, 20, 12]  # an expert without tokens in the middle
    offs = torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32)
    x, b = _randn(sum(counts), 48, seed=3, dtype=dtype), _randn(4, 48, 24, seed=4, dtype=dtype)
    starts = [0] + offs[:-1].tolist()
    ref = torch.cat([x[s:e].double() @ b[i].double()
                     for i, (s, e) in enumerate(zip(starts, offs.tolist()))])
    got = tm.grouped_matmul(x, b, offs)
    assert ((got.double() - ref).abs() / (ref.abs() + 1)).max() <= tol


def test_row_kernels_match_torch():
    from parallel_models.llama.layers.exact import triton_rows as tr
    from parallel_models.llama.layers.fused_ops import _rms_norm

    x, w = _randn(7, 3, 48, seed=1), _randn(48, seed=2)
    torch.testing.assert_close(tr.rms_norm(x, w, 1e-6), _rms_norm(x, w, 1e-6), atol=1e-5, rtol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    torch.testing.assert_close(tr.rms_norm(xb, wb, 1e-6).float(),
                               _rms_norm(xb, wb, 1e-6).float(), atol=0.07, rtol=2e-2)
    torch.testing.assert_close(tr.softmax(x), torch.softmax(x, -1), atol=1e-6, rtol=1e-5)
    sm = tr.softmax(xb, torch.float32)
    assert sm.dtype == torch.float32
    torch.testing.assert_close(sm, torch.softmax(xb, -1, dtype=torch.float32), atol=1e-6, rtol=1e-5)
    logits = _randn(6, 5000, seed=3) * 4  # spans three vocab blocks
    labels = torch.randint(0, 5000, (6,), generator=_g(4)).to(DEV)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(tr.token_log_probs(logits, labels, 0.7), ref, atol=1e-5, rtol=1e-5)
    index = torch.randint(0, 5, (13,), generator=_g(5)).to(DEV)
    src, base = _randn(13, 300, seed=6), _randn(5, 300, seed=7)
    torch.testing.assert_close(tr.index_add_rows(base, index, src), base.index_add(0, index, src),
                               atol=1e-5, rtol=1e-5)


def _packed_qkv(lengths, dtype, heads=4, kv=2, d=16):
    total = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                      device=DEV)
    return (_randn(total, heads, d, seed=1, dtype=dtype), _randn(total, kv, d, seed=2, dtype=dtype),
            _randn(total, kv, d, seed=3, dtype=dtype), cu)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_attention_matches_sdpa_and_decode_equals_prefill(dtype, tol):
    from parallel_models.llama.layers.attention_kernels import _sdpa_per_sequence
    from parallel_models.llama.layers.exact import ops

    lengths = [5, 70, 9]  # 70: two key blocks and two query blocks
    q, k, v, cu = _packed_qkv(lengths, dtype)
    out = ops.varlen_attention(q, k, v, cu, max(lengths))
    ref = _sdpa_per_sequence(q.double(), k.double(), v.double(), cu, None)
    assert (out.double() - ref).abs().max() <= tol
    # decode: the query at position p of each sequence, keys 0..p read from a "cache" (the
    # packed k/v at the sequence's start): the same bits as inside the packed prefill
    picks = torch.tensor([4, 5 + 66, 75 + 3], device=DEV)
    lens = torch.tensor([4, 66, 3], device=DEV)
    decoded = ops.decode_attention(q[picks], k, v, cu[:-1], lens)
    assert torch.equal(decoded, out[picks])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_batch(dtype):
    from parallel_models.llama.layers.exact import ops
    from parallel_models.llama.layers.exact import triton_matmul as tm
    from parallel_models.llama.layers.exact import triton_rows as tr

    a, w = _randn(100, 48, seed=1, dtype=dtype), _randn(40, 48, seed=2, dtype=dtype)
    batch = tm.matmul(a, w.t())
    for rows in (slice(9, 10), slice(9, 12), slice(70, 100)):  # alone, shifted, last tile
        assert torch.equal(tm.matmul(a[rows], w.t()), batch[rows])
    nw = _randn(48, seed=3, dtype=dtype)
    assert torch.equal(tr.rms_norm(a[9:10], nw, 1e-6), tr.rms_norm(a, nw, 1e-6)[9:10])
    labels = torch.randint(0, 48, (100,), generator=_g(4)).to(DEV)
    assert torch.equal(tr.token_log_probs(a[9:12], labels[9:12]),
                       tr.token_log_probs(a, labels)[9:12])
    # a packed sequence alone and behind another: the same attention output
    q, k, v, cu = _packed_qkv([30, 40], dtype)
    joint = ops.varlen_attention(q, k, v, cu, 40)
    alone = ops.varlen_attention(q[30:], k[30:], v[30:],
                                 torch.tensor([0, 40], dtype=torch.int32, device=DEV), 40)
    assert torch.equal(alone, joint[30:])


def test_mode_routes_megatron_ops_and_grads(monkeypatch):
    import torch.nn.functional as F

    from parallel_models.llama.layers.exact import exact_mode, mode, triton_matmul, triton_rows

    calls = []
    for module, name in ((triton_matmul, "matmul"), (triton_matmul, "grouped_matmul"),
                         (triton_rows, "softmax"), (triton_rows, "index_add_rows")):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _fn=fn, _n=name, **k: (calls.append(_n),
                                                                            _fn(*a, **k))[1])
    x = _randn(6, 8, seed=1).requires_grad_()
    w = _randn(5, 8, seed=2).requires_grad_()
    b = _randn(3, 8, 4, seed=3)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32, device=DEV)
    index = torch.tensor([0, 1, 0, 2, 1, 0], device=DEV)

    def run():
        y = F.linear(x, w)
        s = torch.softmax(y, dim=-1)
        out = torch.zeros(3, 5, device=DEV).scatter_add_(0, index[:, None].expand(-1, 5), s)
        grouped = hasattr(torch, "_grouped_mm") and DEV == "cpu"  # CUDA's takes bf16 only
        g = torch._grouped_mm(x, b, offs=offs) if grouped else None
        return out, g

    ref_out, _ = run()
    ref_grads = torch.autograd.grad(ref_out.square().sum(), (x, w))
    assert calls == [] and not mode.enabled()
    with exact_mode():
        assert mode.enabled()
        out, g = run()
        grads = torch.autograd.grad(out.square().sum(), (x, w))
    assert not mode.enabled()
    expected = ["matmul", "softmax", "index_add_rows"]
    if g is not None:
        expected.append("grouped_matmul")
    assert calls == expected
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):  # the backward is the reference op's
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("grad", [False, True])
def test_mode_sorts_every_topk(grad):
    """megatron-core >= 0.19 routes with ``topk(sorted=torch.is_grad_enabled())``: exact mode makes
    every top-k sorted, so the scoring (no grad) and update (grad) forwards see the k router
    scores in one order (their softmax sums them in that order)."""
    from parallel_models.llama.layers.exact import exact_mode

    scores = _randn(64, 16, seed=4)
    want_values, want_index = torch.topk(scores, 4, dim=1, sorted=True)
    with exact_mode(), torch.set_grad_enabled(grad):
        for call in (lambda: torch.topk(scores, k=4, dim=1, sorted=False),
                     lambda: torch.topk(scores, 4, 1, True, False),
                     lambda: scores.topk(4, dim=1, sorted=False)):
            values, index = call()
            assert torch.equal(values, want_values) and torch.equal(index, want_index)
