"""FP8 (e4m3) quantization of the FP8 rollout (parallel_models.inference.fp8): quantize ->
dequantize stays within e4m3's rounding bound per element (2^-4 relative for normal values, half
the subnormal step 2^-10 of the block scale otherwise), the scales are amax / 448 of the blocks
an independent loop finds, zero blocks and shapes that are not multiples of 128 work, and the
emulated FP8 linear is within the error bound derived from the element bounds of the float
linear."""

import pytest
import torch

from parallel_models.inference.fp8 import (BLOCK, E4M3, E4M3_MAX, dequantize_activation,
                                           emulated_matmul, fp8_linear, gemm_backend,
                                           quantize_activation, quantize_weight,
                                           weight_scale_shape)

U = 2.0 ** -4  # e4m3: 3 mantissa bits, round to nearest: relative error <= 2^-4 (normals)
SUB = 2.0 ** -10  # half the subnormal step 2^-9 (in units of the scale)


def _blocks(rows, cols, block_rows, block_cols):
    for i in range(0, rows, block_rows):
        for j in range(0, cols, block_cols):
            yield slice(i, i + block_rows), slice(j, j + block_cols)


def _weight(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many binades, so blocks hold normals and (scaled) subnormals
    return torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-14, 3, (rows, cols),
                                                                           generator=g).float())


def _element_scales(scale, granularity, shape):
    if granularity == "channel":
        return scale[:, None].expand(shape)
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return full[: shape[0], : shape[1]]


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (5, 130)])
@pytest.mark.parametrize("granularity", ["block", "channel"])
def test_weight_roundtrip_within_e4m3_bound(shape, granularity):
    w = _weight(*shape)
    q = quantize_weight(w, granularity)
    assert q.data.dtype == E4M3 and q.data.shape == w.shape
    assert q.scale.dtype == torch.float32 and tuple(q.scale.shape) == \
        weight_scale_shape(shape, granularity)
    deq = q.dequantize()
    s = _element_scales(q.scale, granularity, w.shape)
    normal = w.abs() >= s * 2.0 ** -6  # e4m3's smallest normal is 2^-6
    err = (deq - w).abs()
    assert normal.any() and (~normal).any(), "the data should have normals and subnormals"
    assert (err[normal] <= U * w.abs()[normal] * (1 + 1e-6)).all()
    assert (err[~normal] <= SUB * s[~normal] * (1 + 1e-6)).all()


def test_block_scales_are_block_amax_over_448_and_the_amax_is_exact():
    w = _weight(300, 200, seed=1)
    q = quantize_weight(w, "block")
    for rows, cols in _blocks(300, 200, BLOCK, BLOCK):
        bi, bj = rows.start // BLOCK, cols.start // BLOCK
        amax = w[rows, cols].abs().max()
        assert q.scale[bi, bj] == pytest.approx(float(amax) / 448.0, rel=1e-6)
        # the largest value maps to +-448 exactly
        assert q.data[rows, cols].float().abs().max() == E4M3_MAX


def test_channel_scales_are_row_amax_over_448():
    w = _weight(40, 300, seed=2)
    q = quantize_weight(w, "channel")
    assert torch.allclose(q.scale, w.abs().amax(dim=1) / 448.0, rtol=1e-6, atol=0)


def test_zero_blocks_quantize_to_exact_zeros():
    w = _weight(256, 256, seed=3)
    w[:128, 128:] = 0  # one all-zero block
    w[200] = 0  # a zero row inside other blocks
    for granularity in ("block", "channel"):
        q = quantize_weight(w, granularity)
        assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
        deq = q.dequantize()
        assert (deq[:128, 128:] == 0).all() and (deq[200] == 0).all()
    assert quantize_weight(w, "block").scale[0, 1] == 1.0


def test_subnormal_grid_values_roundtrip_exactly():
    # a block whose amax makes the scale 1 (amax 448): multiples of 2^-9 below 2^-6 are
    # e4m3 subnormals and must come back unchanged
    w = torch.zeros(BLOCK, BLOCK)
    w[0, 0] = 448.0
    k = torch.arange(1, 8, dtype=torch.float32)
    w[1, 1:8] = k * 2.0 ** -9
    w[2, 1:8] = -k * 2.0 ** -9
    deq = quantize_weight(w, "block").dequantize()
    assert torch.equal(deq, w)


def test_in_place_quantization_keeps_the_tensors():
    w = _weight(256, 128)
    q = quantize_weight(w, "block")
    data_ptr, scale_ptr = q.data.data_ptr(), q.scale.data_ptr()
    quantize_weight(2 * w, "block", out=q)
    assert q.data.data_ptr() == data_ptr and q.scale.data_ptr() == scale_ptr
    assert torch.equal(q.dequantize(), quantize_weight(2 * w, "block").dequantize())


@pytest.mark.parametrize("granularity", ["block", "channel"])
def test_activation_groups_within_bound(granularity):
    x = _weight(7, 300, seed=4)
    xq, xs = quantize_activation(x, granularity)
    expect = (7, 3) if granularity == "block" else (7,)
    assert tuple(xs.shape) == expect and xq.dtype == E4M3
    deq = dequantize_activation(xq, xs, granularity)
    if granularity == "block":
        s = xs.repeat_interleave(BLOCK, 1)[:, :300]
        for t in range(7):  # scale = amax of the token's 128-wide group / 448
            for g in range(3):
                group = x[t, g * BLOCK:(g + 1) * BLOCK]
                assert xs[t, g] == pytest.approx(float(group.abs().max()) / 448, rel=1e-6)
    else:
        s = xs[:, None].expand_as(x)
    err = (deq - x).abs()
    assert (err <= torch.maximum(U * x.abs(), SUB * s) * (1 + 1e-6)).all()


def _bound(x, w, granularity):
    """|fp8 linear - float linear| <= |Ex| |W|^T + |x| Ew^T + Ex Ew^T with E the element
    bounds of the activation and weight rounding (plus float32 summation slack)."""
    xq, xs = quantize_activation(x, granularity)
    q = quantize_weight(w, granularity)
    sx = xs.repeat_interleave(BLOCK, 1)[:, : x.shape[1]] if granularity == "block" else \
        xs[:, None].expand_as(x)
    ex = torch.maximum(U * x.abs(), SUB * sx)
    ew = torch.maximum(U * w.abs(), SUB * _element_scales(q.scale, granularity, w.shape))
    slack = 1e-5 * (x.abs() @ w.abs().t())
    return ex @ w.abs().t() + x.abs() @ ew.t() + ex @ ew.t() + slack, q


@pytest.mark.parametrize("granularity", ["block", "channel"])
def test_emulated_linear_within_derived_bound(granularity):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 320, generator=g)
    w = torch.randn(200, 320, generator=g) * 0.05
    bound, q = _bound(x, w, granularity)
    ref = x.double() @ w.double().t()
    out = emulated_matmul(x, q)
    err = (out.double() - ref).abs()
    assert (err <= bound.double()).all()
    assert err.max() > 0  # (the rounding does show)
    # fp8_linear: any leading shape, bias after the product, the CPU takes the emulation
    bias = torch.randn(200, generator=g)
    assert gemm_backend(x, q) == "emulated"
    y = fp8_linear(x.view(3, 3, 320), q, bias)
    assert y.shape == (3, 3, 200) and torch.allclose(y.view(9, 200), out + bias, atol=1e-6)


def test_bad_granularity_names_the_choices():
    with pytest.raises(ValueError, match="block"):
        quantize_weight(torch.ones(4, 4), "tensor")
