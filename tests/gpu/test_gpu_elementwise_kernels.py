"""The Triton SwiGLU / RMSNorm kernels (llama/layers/elementwise_triton.py) on CUDA: at the
Llama-3-8B widths (intermediate 14336, hidden 4096; Qwen3's per-head norms of 128) against the
eager reference (fp32: as close to a float64 oracle as eager and the compiled path are; bf16
forwards equal eager's bits but for a few fp32-ulp flips, bf16 gradients within a rounding step
or two) and against the compiled path they replace; ``fused_ops`` dispatches to them (and not with the switch off); a tiny Llama's loss and
gradients with the kernels on vs off (the compiled path): bf16 within bf16 tolerance, fp32
within 1e-4."""

from __future__ import annotations

import pytest
import torch

from parallel_models.llama.layers import elementwise_triton as et
from parallel_models.llama.layers import fused_ops

DEV = "cuda"
T = 1024  # tokens: enough rows for every SM and several backward tiles per program


def _rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(shape, device=DEV, generator=g) * scale).to(dtype)


def _run(fn, inputs, out_grads):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs, leaves, out_grads)
    return [o.detach() for o in outs], list(grads)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _check(got, want, dtype, what):
    if dtype == torch.float32:
        err = ((got - want).abs() - 1e-5 * want.abs()).max().item()
        assert err <= 1e-5, f"{what}: {err:.3g}"
    else:  # bf16: elementwise within two rounding steps, and close as a whole
        err = ((got.float() - want.float()).abs() - 1.6e-2 * want.float().abs()).max().item()
        assert err <= 2e-2 and _rel(got, want) < 1e-2, f"{what}: {err:.3g}, rel {_rel(got, want)}"


def _rms64(x, w, eps=1e-5):
    """RMSNorm in float64 throughout (the reference's fp32 cast left out): the oracle."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rms64_with_residual(x, residual, w, eps=1e-5):
    total = x + residual
    return total, _rms64(total, w, eps)


@pytest.fixture
def compiled_path():
    """Call ``fn`` through ``fused_ops`` with the kernels switched off (the compiled path)."""
    def call(fn, *args):
        et.set_enabled(False)
        try:
            return fn(*args)
        finally:
            et.set_enabled(None)
    return call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_at_8b_width(dtype, compiled_path):
    inter = 14336
    gate_up = _rand((T, 2 * inter), dtype, 0, scale=3.0)
    dout = _rand((T, inter), dtype, 1)
    (want,), [want_g] = _run(fused_ops._swiglu, [gate_up], [dout])
    (got,), [got_g] = _run(et.swiglu, [gate_up], [dout])
    _check(got, want, dtype, "out")
    _check(got_g, want_g, dtype, "d(gate_up)")
    if dtype == torch.bfloat16:
        assert (got != want).float().mean().item() < 1e-3  # eager's roundings, bit for bit
    (comp,), [comp_g] = compiled_path(_run, fused_ops.swiglu, [gate_up], [dout])
    _check(got, comp, dtype, "out vs compiled")
    _check(got_g, comp_g, dtype, "grad vs compiled")
    # 3-D input ([s, b, 2I] as megatron lays it out), and an odd width
    (got3,), [got3_g] = _run(et.swiglu, [gate_up.view(T // 2, 2, -1)], [dout.view(T // 2, 2, -1)])
    assert torch.equal(got3.view(T, -1), got) and torch.equal(got3_g.view(T, -1), got_g)
    odd = _rand((T, 2 * 1001), dtype, 2)
    d_odd = _rand((T, 1001), dtype, 3)
    (want,), [want_g] = _run(fused_ops._swiglu, [odd], [d_odd])
    (got,), [got_g] = _run(et.swiglu, [odd], [d_odd])
    _check(got, want, dtype, "odd out")
    _check(got_g, want_g, dtype, "odd grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(T, 4096), (T, 32, 128), (T, 4096 + 24)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norms_at_8b_width(shape, dtype, residual, compiled_path):
    x = _rand(shape, dtype, 4, scale=2.0)
    w = _rand(shape[-1:], dtype, 5) + 1
    dy = _rand(shape, dtype, 6)
    if residual:
        res, d_total = _rand(shape, dtype, 7), _rand(shape, dtype, 8)
        inputs, grads = [x, res, w], [d_total, dy]
        ref, ours, comp = (lambda a, b, c: fused_ops._add_rms_norm(a, b, c, 1e-5),
                           lambda a, b, c: et.add_rms_norm(a, b, c, 1e-5),
                           lambda a, b, c: fused_ops.add_rms_norm(a, b, c, 1e-5))
    else:
        inputs, grads = [x, w], [dy]
        ref, ours, comp = (lambda a, b: fused_ops._rms_norm(a, b, 1e-5),
                           lambda a, b: et.rms_norm(a, b, 1e-5),
                           lambda a, b: fused_ops.rms_norm(a, b, 1e-5))
    want, want_g = _run(ref, inputs, grads)
    got, got_g = _run(ours, inputs, grads)
    other, other_g = compiled_path(_run, comp, inputs, grads)
    if dtype == torch.float32:
        # fp32: the weight gradient sums 1024+ rows, so each summation order is off by a few
        # fp32 ulps of the row count; the oracle is float64, and ours must be as close to it as
        # eager or the compiled path are (within 2x)
        ref64 = _rms64_with_residual if residual else _rms64
        exact, exact_g = _run(ref64, [t.double() for t in inputs], [g.double() for g in grads])
        for g, w_, o, r, what in zip(got + got_g, want + want_g, other + other_g,
                                     exact + exact_g, ["out"] * len(got) + ["grad"] * len(got_g)):
            errs = [(t.double() - r).abs().max().item() for t in (g, w_, o)]
            bound = 2 * max(errs[1], errs[2]) + 1e-7 * r.abs().max().item()
            assert errs[0] <= bound, (f"{what}: ours {errs[0]:.3g} from float64, eager "
                                      f"{errs[1]:.3g}, compiled {errs[2]:.3g}")
        return
    for g, w_, o, what in zip(got + got_g, want + want_g, other + other_g,
                              ["out"] * len(got) + ["grad"] * len(got_g)):
        if w_ is want_g[-1]:
            # bf16: the weight gradient sums 1024+ rows: eager rounds every row's product to
            # bf16 first; ours and the compiled one add in fp32
            assert _rel(g, o) < 1e-2, f"dw vs compiled: rel {_rel(g, o)}"
            continue
        _check(g, w_, dtype, f"{what} vs eager")
        _check(g, o, dtype, f"{what} vs compiled")
    if dtype == torch.bfloat16:
        assert (got[-1] != want[-1]).float().mean().item() < 1e-3  # y: eager's bits


def test_fused_ops_dispatch_and_switch(monkeypatch):
    monkeypatch.setenv("PARALLEL_MODELS_TRITON_ELEMENTWISE", "1")  # opt-in
    calls = []
    for name in ("swiglu", "rms_norm", "add_rms_norm"):
        fn = getattr(et, name)
        monkeypatch.setattr(et, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    x = _rand((64, 256), torch.bfloat16, 9)
    w = torch.ones(256, device=DEV, dtype=torch.bfloat16)
    fused_ops.swiglu(x)
    fused_ops.rms_norm(x, w, 1e-6)
    fused_ops.add_rms_norm(x, x, w, 1e-6)
    assert calls == ["swiglu", "rms_norm", "add_rms_norm"]
    monkeypatch.setenv("PARALLEL_MODELS_TRITON_ELEMENTWISE", "0")
    fused_ops.swiglu(x)
    fused_ops.rms_norm(x, w, 1e-6)
    fused_ops.add_rms_norm(x, x, w, 1e-6)
    fused_ops.rms_norm(x.double(), w.double(), 1e-6)  # float64: never the kernels
    assert len(calls) == 3


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_tiny_llama_loss_and_gradients_on_vs_off(gpu_models, single_rank, dtype, tol):
    """One forward/backward of a small Llama (3 layers, hidden 256, intermediate 704; two
    packed sequences) with the kernels on and off: the same loss and parameter gradients."""
    import parallel_models as pm
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits

    model = pm.LlamaForCausalLMRmPad.from_pretrained(gpu_models["llama"], dtype=dtype)
    g = torch.Generator(device=DEV).manual_seed(1)
    ids = torch.randint(0, 1001, (700,), device=DEV, generator=g)
    cu = torch.tensor([0, 300, 700], dtype=torch.int32, device=DEV)
    results = {}
    for on in (True, False):
        et.set_enabled(on)
        try:
            model.zero_grad(set_to_none=True)
            loss = -log_probs_from_packed_logits(model(ids, cu).logits, ids, cu).mean()
            loss.backward()
        finally:
            et.set_enabled(None)
        results[on] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (loss_on, grads_on), (loss_off, grads_off) = results[True], results[False]
    assert abs(loss_on.item() - loss_off.item()) <= tol * abs(loss_off.item())
    assert grads_on.keys() == grads_off.keys()
    for name, got in grads_on.items():
        rel = _rel(got, grads_off[name])
        assert rel < tol, f"{name}: kernels on vs off, gradient rel {rel:.2e}"
