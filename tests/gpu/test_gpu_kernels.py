"""Compiled fused ops, attention dispatch and decode attention on CUDA vs their eager/fp32 references."""

from __future__ import annotations

import pytest
import torch

from parallel_models.llama.layers import fused_ops
from parallel_models.utils import gpu_compile

DEV = "cuda"


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _eager_and_compiled(fn_name, *inputs):
    """(eager outputs + grads, compiled outputs + grads) of one fused op on CUDA."""
    results = []
    for compiled in (False, True):
        gpu_compile.set_compilation(compiled)
        try:
            xs = [x.detach().clone().requires_grad_(x.is_floating_point()) if torch.is_tensor(x) else x
                  for x in inputs]
            out = getattr(fused_ops, fn_name)(*xs)
            outs = out if isinstance(out, tuple) else (out,)
            torch.manual_seed(1)
            loss = sum((o.float() * torch.randn_like(o, dtype=torch.float32)).sum() for o in outs)
            loss.backward()
            grads = [x.grad for x in xs if torch.is_tensor(x) and x.grad is not None]
            results.append(([o.detach() for o in outs], grads))
        finally:
            gpu_compile.set_compilation(True)
    return results


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_compiled_fused_ops_match_eager(dtype, tol, monkeypatch):
    assert gpu_compile._compile_available(), "torch.compile (triton) not available on this GPU host"
    # the compiled path, not the opt-in Triton kernels (tests/gpu/test_gpu_elementwise_kernels.py)
    monkeypatch.setenv("PARALLEL_MODELS_TRITON_ELEMENTWISE", "0")
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(300, 256, device=DEV, generator=g).to(dtype)
    res = torch.randn(300, 256, device=DEV, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(256, device=DEV, generator=g)).to(dtype)
    q = torch.randn(300, 8, 64, device=DEV, generator=g).to(dtype)
    k = torch.randn(300, 2, 64, device=DEV, generator=g).to(dtype)
    ang = torch.rand(300, 32, device=DEV, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    gate_up = torch.randn(300, 2 * 704, device=DEV, generator=g).to(dtype)
    cases = {"rms_norm": (x, w, 1e-6), "add_rms_norm": (x, res, w, 1e-6),
             "rotary": (q, k, cos, sin), "swiglu": (gate_up,)}
    for name, args in cases.items():
        (eo, eg), (co, cg) = _eager_and_compiled(name, *args)
        for a, b in zip(co, eo):
            assert _rel(a, b) <= tol, f"{name} {dtype} output rel {_rel(a, b):.2e}"
        assert len(cg) == len(eg) > 0
        for a, b in zip(cg, eg):
            assert _rel(a, b) <= tol, f"{name} {dtype} grad rel {_rel(a, b):.2e}"
    assert counters["stats"]["unique_graphs"] >= len(cases), "the compiled path did not run"


@pytest.mark.parametrize("lengths", [[128, 128, 128], [200, 37, 64, 5]], ids=["equal", "ragged"])
def test_attention_dispatch_matches_fp32_math(lengths):
    """bf16 packed attention (batched SDPA for equal lengths, flash varlen for ragged, GQA read
    directly) vs fp32 SDPA per sequence, outputs and gradients."""
    from parallel_models.llama.layers import attention_kernels as ak

    dev = torch.device(DEV)
    assert ak.available_backend(dev, torch.bfloat16) != "sdpa"
    g = torch.Generator(device=DEV).manual_seed(0)
    t = sum(lengths)
    cu = torch.tensor([0] + lengths, device=DEV).cumsum(0).to(torch.int32)
    q = torch.randn(t, 8, 64, device=DEV, generator=g)
    k = torch.randn(t, 2, 64, device=DEV, generator=g)
    v = torch.randn(t, 2, 64, device=DEV, generator=g)
    dout = torch.randn(t, 8, 64, device=DEV, generator=g)

    def run(dtype, fn):
        xs = [x.detach().to(dtype).clone().requires_grad_() for x in (q, k, v)]
        out = fn(*xs)
        out.backward(dout.to(dtype))
        return out.float(), [x.grad.float() for x in xs]

    ref, ref_g = run(torch.float32, lambda a, b, c: ak._sdpa_per_sequence(a, b, c, cu, None))
    got, got_g = run(torch.bfloat16,
                     lambda a, b, c: ak.varlen_causal_attention(a, b, c, cu, max(lengths)))
    assert _rel(got, ref) <= 2e-2
    for a, b in zip(got_g, ref_g):
        assert torch.isfinite(a).all() and _rel(a, b) <= 2e-2


def test_decode_attention_matches_fp32_reference():
    """Decode attention over a KV cache with per-row fill lengths (flash with ``seqused_k`` and the
    SDPA fallback) vs a plain fp32 softmax over each row's filled keys (GQA repeated by hand)."""
    from parallel_models.inference import kv_cache as kc

    dev = torch.device(DEV)
    assert kc._flash_decode_supported(dev, torch.bfloat16)
    g = torch.Generator(device=DEV).manual_seed(0)
    batch, span, kv_heads, heads, d = 5, 96, 2, 8, 64
    used = [1, 17, 96, 40, 63]
    k_rows = torch.randn(batch, span, kv_heads, d, device=DEV, generator=g).bfloat16()
    v_rows = torch.randn(batch, span, kv_heads, d, device=DEV, generator=g).bfloat16()
    q = torch.randn(batch, heads, d, device=DEV, generator=g).bfloat16()
    scale = d ** -0.5
    ref = []
    for b, n in enumerate(used):
        kk = k_rows[b, :n].float().repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, d]
        vv = v_rows[b, :n].float().repeat_interleave(heads // kv_heads, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), kk) * scale, dim=-1)
        ref.append(torch.einsum("hn,nhd->hd", w, vv))
    ref = torch.stack(ref)
    cu_q = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    used_t = torch.tensor(used, device=DEV, dtype=torch.int32)
    flash = kc._flash_decode(q, k_rows, v_rows, cu_q, cu_q * span, used_t, scale)
    sdpa = kc._sdpa_decode(q, k_rows, v_rows, used_t.long() - 1, span, scale)
    for name, got in (("flash", flash), ("sdpa", sdpa)):
        assert got.shape == ref.shape
        assert _rel(got, ref) <= 1e-2, f"{name} decode rel {_rel(got, ref):.2e}"


def test_vocab_parallel_log_probs_compiled_match_eager():
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits

    g = torch.Generator(device=DEV).manual_seed(0)
    logits = torch.randn(257, 1001, device=DEV, generator=g)
    ids = torch.randint(0, 1001, (257,), device=DEV, generator=g)
    cu = torch.tensor([0, 100, 200, 257], device=DEV, dtype=torch.int32)
    outs = []
    for compiled in (False, True):
        gpu_compile.set_compilation(compiled)
        try:
            x = logits.clone().requires_grad_()
            lp, ent = log_probs_from_packed_logits(x, ids, cu, with_entropy=True)
            (lp.sum() + 0.5 * ent.sum()).backward()
            outs.append((lp.detach(), ent.detach(), x.grad))
        finally:
            gpu_compile.set_compilation(True)
    for a, b in zip(*outs):
        assert (a - b).abs().max().item() <= 1e-5
