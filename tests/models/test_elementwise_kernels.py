"""The Triton SwiGLU / RMSNorm / residual-add RMSNorm kernels (llama/layers/elementwise_triton.py)
in Triton's CPU interpreter (on CUDA where present), forward and backward through autograd,
against the eager definitions in ``fused_ops`` (the reference): fp32 within 1e-5, bf16 and fp16
within a few units in the last place; odd widths (masking), 2-D / 3-D and non-contiguous inputs,
several row tiles per backward program, gradients of one output only. Skipped without triton
(not a dependency)."""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")

from parallel_models.llama.layers import elementwise_triton as et  # noqa: E402
from parallel_models.llama.layers.fused_ops import (_add_rms_norm, _rms_norm,  # noqa: E402
                                                    _swiglu)
from tests.helpers.triton_interpreter import bf16_rounds_to_nearest_even  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="module")
def _bf16_rounds_to_nearest_even():
    """The interpreter's fp32 -> bf16 conversion held to the GPU's (round to nearest even), so
    the bf16 checks hold the kernels to the GPU's roundings (tests/helpers/triton_interpreter)."""
    with bf16_rounds_to_nearest_even():
        yield


# (abs, rel) per dtype: fp32 is ulp-level; half types allow a rounding step or two of outputs ~1-4
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1.6e-2), torch.float16: (4e-3, 2e-3)}


def _close(got, want, dtype, what):
    atol, rtol = TOL[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape, what
    err = ((got.double() - want.double()).abs() - rtol * want.double().abs()).max().item()
    assert err <= atol, f"{what}: {err:.3g} beyond {atol} + {rtol} x |ref|"


def _close_dw(got, x, dy, eps, dtype):
    """A weight gradient (a sum over the rows) against float64 arithmetic: the reference's own
    bf16 / fp16 gradient rounds every row's product before adding, so it is no oracle there.
    Bound: a rounding step or two of each term (sum over the rows of |dy * x_hat|)."""
    rel = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-9}[dtype]
    x64, dy64 = x.double().reshape(-1, x.shape[-1]), dy.double().reshape(-1, x.shape[-1])
    x_hat = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    want, scale = (dy64 * x_hat).sum(0), (dy64 * x_hat).abs().sum(0)
    err = ((got.double() - want).abs() - rel * scale - TOL[dtype][1] * want.abs()).max().item()
    assert err <= 1e-6, f"dw: {err:.3g} beyond {rel} x sum |dy x_hat| + {TOL[dtype][1]} x |ref|"


def _rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEV)


def _grads(fn, inputs, outs_grads):
    """(outputs, gradients of the inputs) of ``fn(*inputs)`` against ``outs_grads``."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(o, g) for o, g in zip(outs, outs_grads) if g is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], [x for x in leaves if x.requires_grad],
                                [g for _, g in pairs], allow_unused=True)
    return [o.detach() for o in outs], grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 2 * 45), (3, 5, 2 * 1030), (1, 2 * 16)])
def test_swiglu_matches_eager(shape, dtype):
    gate_up = _rand(shape, dtype, 0, scale=3.0)  # sigmoid's tails too
    dout = _rand(shape[:-1] + (shape[-1] // 2,), dtype, 1)
    (want,), want_g = _grads(_swiglu, [gate_up], [dout])
    (got,), got_g = _grads(et.swiglu, [gate_up], [dout])
    _close(got, want, dtype, "swiglu out")
    _close(got_g[0], want_g[0], dtype, "swiglu d(gate_up)")
    if dtype == torch.bfloat16:  # eager's roundings kept: the bits agree nearly always
        assert (got != want).float().mean().item() < 0.01


def test_swiglu_non_contiguous_and_masked_block():
    base = _rand((6, 2 * 2100 + 3), torch.float32, 2)
    gate_up = base[:, 3:]  # rows strided by 2 * 2100 + 3: a view, no copy
    dout = _rand((6, 2100), torch.float32, 3).t().contiguous().t()  # column-major gradient
    old = et.CONFIG
    et.CONFIG = dataclasses.replace(et.launch_config(), swiglu_block=512)  # 2100 = 4 blocks
    try:  # + a masked one
        (want,), want_g = _grads(_swiglu, [gate_up], [dout])
        (got,), got_g = _grads(et.swiglu, [gate_up], [dout])
    finally:
        et.CONFIG = old
    _close(got, want, torch.float32, "out")
    _close(got_g[0], want_g[0], torch.float32, "grad")
    with pytest.raises(ValueError, match="even"):
        et.swiglu(torch.zeros(2, 5, device=DEV))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(37, 100), (2, 9, 24), (5, 4096 + 13)])
def test_rms_norm_matches_eager(shape, dtype):
    x = _rand(shape, dtype, 4, scale=2.0)
    w = _rand(shape[-1:], dtype, 5) + 1
    dy = _rand(shape, dtype, 6)
    (want,), want_g = _grads(lambda a, b: _rms_norm(a, b, 1e-6), [x, w], [dy])
    (got,), got_g = _grads(lambda a, b: et.rms_norm(a, b, 1e-6), [x, w], [dy])
    _close(got, want, dtype, "y")
    _close(got_g[0], want_g[0], dtype, "dx")
    _close_dw(got_g[1], x, dy, 1e-6, dtype)


def test_rms_norm_backward_walks_several_tiles_per_program():
    """Small rows pack several per tile (the last one partial), and the 2 interpreter programs
    (4 x SMs on CUDA) each walk several tiles: the partial weight gradients add up."""
    x = _rand((4 * 1000 + 3, 24), torch.float32, 7)  # 128 rows a tile, 32 tiles
    w = _rand((24,), torch.float32, 8)
    dy = _rand(x.shape, torch.float32, 9)
    old = et.CONFIG
    et.CONFIG = dataclasses.replace(et.launch_config(), norm_programs_per_sm=1)
    try:
        (want,), want_g = _grads(lambda a, b: _rms_norm(a, b, 1e-5), [x, w], [dy])
        (got,), got_g = _grads(lambda a, b: et.rms_norm(a, b, 1e-5), [x, w], [dy])
    finally:
        et.CONFIG = old
    _close(got, want, torch.float32, "y")
    _close(got_g[0], want_g[0], torch.float32, "dx")
    _close_dw(got_g[1], x, dy, 1e-5, torch.float32)


def test_rms_norm_mixed_dtypes_and_non_contiguous_input():
    """bf16 rows with an fp32 weight give fp32 outputs (PyTorch's promotion); a transposed
    input is copied to rows and its gradient comes back in its shape."""
    x = _rand((24, 11), torch.bfloat16, 10).t()  # [11, 24], non-contiguous
    w = _rand((24,), torch.float32, 11) + 1
    dy = _rand((11, 24), torch.float32, 12)
    (want,), want_g = _grads(lambda a, b: _rms_norm(a, b, 1e-6), [x, w], [dy])
    (got,), got_g = _grads(lambda a, b: et.rms_norm(a, b, 1e-6), [x, w], [dy])
    _close(got, want, torch.bfloat16, "y")
    _close(got_g[0], want_g[0], torch.bfloat16, "dx")
    _close_dw(got_g[1], x, dy, 1e-6, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(33, 1, 80), (19, 4096 + 5)])
@pytest.mark.parametrize("used", ["both", "normed", "total"])
def test_add_rms_norm_matches_eager(shape, dtype, used):
    """Both outputs' gradients reach x and residual (the sum's gradient plus the norm's), or one
    output only (the other's gradient is None, not materialized)."""
    x, res = _rand(shape, dtype, 13, scale=2.0), _rand(shape, dtype, 14)
    w = _rand(shape[-1:], dtype, 15) + 1
    d_total = _rand(shape, dtype, 16) if used != "normed" else None
    d_y = _rand(shape, dtype, 17) if used != "total" else None
    want, want_g = _grads(lambda a, b, c: _add_rms_norm(a, b, c, 1e-6), [x, res, w],
                          [d_total, d_y])
    got, got_g = _grads(lambda a, b, c: et.add_rms_norm(a, b, c, 1e-6), [x, res, w],
                        [d_total, d_y])
    _close(got[0], want[0], dtype, "total")
    _close(got[1], want[1], dtype, "y")
    _close(got_g[0], want_g[0], dtype, "dx")
    _close(got_g[1], want_g[1], dtype, "dresidual")
    if used == "total":
        assert got_g[2] is None or not got_g[2].any()
    else:
        _close_dw(got_g[2], (x + res), d_y, 1e-6, dtype)


def test_switch_and_dispatch_rules(monkeypatch):
    """The option (and its environment variable) and the run-time override; CPU tensors never
    come here."""
    from parallel_models.options import options_override

    x = torch.zeros(2, 4)
    monkeypatch.delenv("PARALLEL_MODELS_TRITON_ELEMENTWISE", raising=False)
    assert not et.enabled(), "opt-in"
    with options_override(triton_elementwise=True):
        assert et.enabled()
    monkeypatch.setenv("PARALLEL_MODELS_TRITON_ELEMENTWISE", "0")
    assert not et.enabled()
    et.set_enabled(True)
    try:
        assert et.enabled()
        assert not et.use_for(x)  # CPU: fused_ops keeps the eager reference
    finally:
        et.set_enabled(None)
    monkeypatch.setenv("PARALLEL_MODELS_TRITON_ELEMENTWISE", "1")
    assert et.enabled() and et.available()


def test_launch_config_from_options(monkeypatch):
    import dataclasses
    import typing

    from parallel_models.errors import ConfigError
    from parallel_models.options import ElementwiseLaunchField, options_override

    # the option names exactly the launch config's fields
    assert set(typing.get_args(ElementwiseLaunchField)) == \
        {f.name for f in dataclasses.fields(et.LaunchConfig)}
    monkeypatch.delenv("PARALLEL_MODELS_ELEMENTWISE_LAUNCH", raising=False)
    assert et.launch_config() == et.LaunchConfig()
    with options_override(elementwise_launch={"norm_tile": 8192}):
        assert et.launch_config() == et.LaunchConfig(norm_tile=8192)
    monkeypatch.setenv("PARALLEL_MODELS_ELEMENTWISE_LAUNCH", "norm_tile=8192, swiglu_block=512")
    config = et.LaunchConfig.from_options()
    assert (config.norm_tile, config.swiglu_block, config.swiglu_warps) == (8192, 512, 4)
    monkeypatch.setenv("PARALLEL_MODELS_ELEMENTWISE_LAUNCH", "tile=1")
    with pytest.raises(ConfigError, match="PARALLEL_MODELS_ELEMENTWISE_LAUNCH='tile=1'"):
        et.LaunchConfig.from_options()
    monkeypatch.setattr(et, "CONFIG", et.LaunchConfig(norm_tile=3000))
    assert et._norm_tile(100) == (16, 128, 4)  # 3000 // 128 = 23 rows -> 16 (a power of two)


def test_flat_rows():
    x = torch.zeros(4, 6, 8)
    assert et.flat_rows(x) and et.flat_rows(x[1:3]) and et.flat_rows(x[:, :, :5])
    assert et.flat_rows(x.view(24, 1, 8)) and et.flat_rows(torch.zeros(8))
    assert et.flat_rows(torch.zeros(1, 8).expand(5, 8))  # one row stride (0): read in place
    assert not et.flat_rows(x[:, :3])  # a head slice of [tokens, heads, d]: a copy to flatten
    assert not et.flat_rows(x.transpose(0, 1)) and not et.flat_rows(x[..., ::2])
