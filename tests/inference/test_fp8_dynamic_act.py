"""The FP8 rollout's W8A8 decode GEMMs (``inference/fp8/dynamic_act_kernel.py``: e4m3 weights,
bf16 activations quantized per token and 128-wide group inside the kernel, or by a quantization
kernel before it: ``prequantized_mm``, the ``"w8a8"`` kernel) in Triton's
CPU interpreter (on CUDA where present) against the prefill's recipe it must reproduce:
``quantize.quantize_activation(x, "block")`` dequantized, times the dequantized weight, in fp32
(the kernel's interpreter path rounds to e4m3 itself and takes an fp32 dot: the interpreter's own
fp32 -> e4m3 conversion is wrong, see the module docstring). Block and channel weight scales,
decode row counts, widths that are not multiples of the tiles or of 128, an all-zero activation
group, the tile configs the tuning chooses among (row tiles, K splits with empty splits, one or
two groups a K step, strips spanning scale-block rows), the e4m3 rounding the interpreter
path uses against torch's conversion, and ``gemm.DECODE_KERNEL``'s choice of kernel (checked
once when selected, the other kernel where one fails). Skipped without triton (not a
dependency)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from parallel_models.inference.fp8 import (decode_gemm_shared, dynamic_act_kernel,  # noqa: E402
                                           e4m3_rounding)
from parallel_models.inference.fp8.decode_tuning import DecodeConfig, row_bucket  # noqa: E402
from parallel_models.inference.fp8.gemm import (block_scale_storage,  # noqa: E402
                                                dynamic_matmul, weight_only_matmul)
from parallel_models.inference.fp8.quantize import (QuantizedWeight,  # noqa: E402
                                                    dequantize_activation, quantize_activation,
                                                    quantize_weight)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ACT = torch.bfloat16 if DEV == "cuda" else torch.float32  # (interpreter: fp32 dots)


def _operands(rows, out, inp, granularity, seed=0):
    g = torch.Generator().manual_seed(rows + out + seed)
    w = torch.randn(out, inp, generator=g)
    x = torch.randn(rows, inp, generator=g) * torch.rand(rows, 1, generator=g) * 4
    x[0, :min(inp, 128)] = 0  # an all-zero group: scale 1, its products 0
    x = x.to(DEV, ACT)
    q = quantize_weight(w.to(DEV), granularity)
    if granularity == "block":  # the rollout linears' layout: rows of the scales padded to 4
        storage = block_scale_storage(out, inp, DEV)
        storage.copy_(q.scale)
        q = QuantizedWeight(q.data, storage, granularity)
    return x, q


def _prefill_recipe(x, q):
    """The oracle: the prefill's activation quantization (1 x 128 groups), fp32 product."""
    xq, xs = quantize_activation(x.float(), "block")
    return dequantize_activation(xq, xs, "block") @ q.dequantize(torch.float32).t()


def _check(got, x, q):
    want = _prefill_recipe(x, q)
    assert got.shape == want.shape and not got.isnan().any()
    # the same e4m3 operands and scales: the accumulation order differs (and on the GPU the bf16
    # output rounding)
    rtol = 2 ** -7 if ACT == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=rtol * want.abs().max().item())
    return want


# the two W8A8 kernels: activations quantized in the GEMM's K loop, or by a kernel before it
MMS = {"dynamic": dynamic_act_kernel.dynamic_act_mm, "w8a8": dynamic_act_kernel.prequantized_mm}


@pytest.mark.parametrize("kernel", sorted(MMS))
@pytest.mark.parametrize("granularity", ["block", "channel"])
@pytest.mark.parametrize("rows,out,inp", [(1, 256, 384), (16, 200, 300), (64, 128, 256)])
def test_kernel_equals_the_prefill_recipe(granularity, rows, out, inp, kernel):
    x, q = _operands(rows, out, inp, granularity)
    got = MMS[kernel](x, q).float()
    want = _check(got, x, q)
    torch.testing.assert_close(dynamic_matmul(x, q).float(), want, rtol=1e-5 if DEV == "cpu"
                               else 2 ** -7, atol=1e-4 * want.abs().max().item())
    # the activations are quantized: not the weight-only product (the FP8 rounding of x shows)
    assert (got - weight_only_matmul(x, q).float()).abs().max() > 1e-4 * want.abs().max()


def test_bf16_activations_on_e4m3_ties_round_like_the_recipe():
    """bf16 activations over a bf16 amax land exactly on e4m3 ties (x / scale = 200.0, between 192
    and 208) in ~5 of 10^4 elements; the kernel's ``x * (1 / scale)`` must round them as the recipe
    does. (The recipe divided until session 16: the GPU test found the outputs up to 6 % off while
    this interpreter test, on fp32 activations without ties, passed.)"""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 1024, generator=g) * 2).bfloat16().float()  # bf16 values, many ties
    groups = x.view(64, 8, 128)
    scale = groups.abs().amax(2, keepdim=True) / 448
    ties = ((groups / scale).to(torch.float8_e4m3fn).float()
            != (groups * (1 / scale)).to(torch.float8_e4m3fn).float()).sum()
    assert ties > 10  # the case is exercised: division and reciprocal round these apart
    q = quantize_weight(torch.randn(96, 1024, generator=g), "channel")
    x = x.to(DEV, ACT)
    q = QuantizedWeight(q.data.to(DEV), q.scale.to(DEV), "channel")
    got = dynamic_act_kernel.dynamic_act_mm(x, q).float()
    want = _prefill_recipe(x, q)
    if DEV == "cpu":  # the same e4m3 operands: only the fp32 summation order differs
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:
        _check(got, x, q)


CONFIGS = [  # (rows, out, inp, config)
    (37, 128, 512, DecodeConfig(32, 16, 128, 2, num_warps=4, num_stages=2)),  # 3 row tiles
    (40, 128, 512, DecodeConfig(64, 32, 256, 2, num_warps=4, num_stages=2)),  # 2 groups a step
    (5, 96, 640, DecodeConfig(32, 16, 128, 8, num_warps=4, num_stages=2)),  # 8 splits, 3 empty
    (17, 160, 400, DecodeConfig(128, 16, 256, 3, num_warps=4, num_stages=3)),  # K 400: a partial
    (20, 300, 300, DecodeConfig(256, 32, 128, 2, num_warps=4, num_stages=2)),  # group; 256-row
    (64, 256, 384, DecodeConfig(128, 64, 256, 1, num_warps=8, num_stages=2)),  # strips span 2
]  # scale-block rows


@pytest.mark.parametrize("kernel", sorted(MMS))
@pytest.mark.parametrize("granularity", ["block", "channel"])
@pytest.mark.parametrize("rows,out,inp,cfg", CONFIGS)
def test_tile_configs_and_k_splits(granularity, rows, out, inp, cfg, kernel):
    x, q = _operands(rows, out, inp, granularity, seed=1)
    _check(MMS[kernel](x, q, cfg), x, q)
    if cfg.split_k > 1:  # the last program of each tile reset its counter for the next call
        _, counters = decode_gemm_shared._workspaces[(str(x.device), cfg.split_k,
                                                      row_bucket(rows), out)]
        assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("kernel", sorted(MMS))
def test_k_steps_must_be_whole_activation_groups(kernel):
    x, q = _operands(16, 128, 256, "channel")
    with pytest.raises(ValueError, match="multiple of the 128-wide activation groups"):
        MMS[kernel](x, q, DecodeConfig(64, 16, 64, 1, 4, 2))


@triton.jit
def _round_kernel(V, R, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(R + offs, e4m3_rounding.round_to_e4m3(tl.load(V + offs, mask=ok)), mask=ok)


@pytest.mark.skipif(DEV == "cuda", reason="the interpreter's stand-in for the e4m3 conversion")
def test_interpreter_rounding_equals_torch_e4m3():
    """Every e4m3 value, the midpoints between neighbours (ties to even) and their fp32
    neighbours, subnormals, and random values in +-448 round as ``.to(float8_e4m3fn)`` does."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    values = codes.float()[~codes.float().isnan()].sort().values
    mids = (values[1:] + values[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    v = torch.cat([values, mids, torch.nextafter(mids, torch.full_like(mids, 1e9)),
                   torch.nextafter(mids, torch.full_like(mids, -1e9)),
                   (torch.rand(4096, generator=g) * 2 - 1) * 448,
                   (torch.rand(4096, generator=g) * 2 - 1) * 2 ** -5]).clamp(-448, 448)
    got = torch.empty_like(v)
    _round_kernel[(triton.cdiv(v.numel(), 1024),)](v, got, v.numel(), BLOCK=1024)
    want = v.to(torch.float8_e4m3fn).float()
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


def test_decode_kernel_switch_checks_the_selected_kernel_and_falls_back(monkeypatch):
    """``gemm.DECODE_KERNEL`` picks the kernel of decode-sized products; selecting one runs its
    device check (once) outside a capture; a kernel that failed its check gives way to the
    other; neither passing leaves the product to ``_scaled_mm`` / the emulation (None). The
    default, the TMA kernel, takes channel-scaled weights only: block ones skip it unchecked."""
    from parallel_models.inference.fp8 import gemm
    from parallel_models.inference.fp8.tma_decode_kernel import tma_mm
    from parallel_models.inference.fp8.weight_only_kernel import weight_only_mm

    verdicts = {"dynamic": True, "weight_only": True, "w8a8": True, "tma": True}
    checked = []

    def fake_check(device, granularity, kernel):
        checked.append(kernel)
        return verdicts[kernel], "fails on purpose"

    monkeypatch.setattr(gemm, "_decode_check", fake_check)
    monkeypatch.setattr(gemm, "_decode_checked", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    dev = torch.device("cpu")
    assert gemm.DECODE_KERNEL == "tma"  # the default (measured on an H100)
    assert gemm._decode_mm(dev, "channel") is tma_mm and checked == ["tma"]
    assert gemm._decode_mm(dev, "block") is weight_only_mm and checked == ["tma", "weight_only"]
    assert gemm.decode_kernel(dev, "block") == "weight_only"
    assert gemm.decode_emulation("tma") is gemm.token_matmul
    checked.clear()
    monkeypatch.setattr(gemm, "_decode_checked", {})
    monkeypatch.setattr(gemm, "DECODE_KERNEL", "dynamic")
    assert gemm._decode_mm(dev, "block") is dynamic_act_kernel.dynamic_act_mm
    assert gemm._decode_mm(dev, "block") is dynamic_act_kernel.dynamic_act_mm
    assert checked == ["dynamic"]  # once
    monkeypatch.setattr(gemm, "DECODE_KERNEL", "weight_only")
    assert gemm._decode_mm(dev, "block") is weight_only_mm and checked[-1] == "weight_only"
    verdicts["dynamic"] = False  # a device where the W8A8 kernel fails: the weight-only one
    monkeypatch.setattr(gemm, "DECODE_KERNEL", "dynamic")
    assert gemm._decode_mm(dev, "channel") is weight_only_mm
    assert checked[-2:] == ["dynamic", "weight_only"]
    verdicts["weight_only"] = False  # then the pre-quantized W8A8 kernel
    assert gemm._decode_mm(dev, "other") is dynamic_act_kernel.prequantized_mm
    monkeypatch.setattr(gemm, "DECODE_KERNEL", "w8a8")
    assert gemm._decode_mm(dev, "other") is dynamic_act_kernel.prequantized_mm
    verdicts["w8a8"] = False
    assert gemm._decode_mm(dev, "third") is None
    monkeypatch.setattr(gemm, "DECODE_KERNEL", "w4a16")
    with pytest.raises(ValueError, match="DECODE_KERNEL must be one of"):
        gemm._decode_mm(dev, "block")
