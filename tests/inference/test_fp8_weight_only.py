"""The FP8 rollout's weight-only decode GEMM (``inference/fp8/weight_only_kernel.py``: e4m3
weights, 16-bit activations) in Triton's CPU interpreter (on CUDA where present) against the
emulation it stands for (``gemm.weight_only_matmul``: ``x @ dequantize(W)^T`` in fp32), for
block and channel scales, decode-sized row counts, widths that are not multiples of the tiles,
the scale layout the rollout linears keep (rows padded to 4), and the tile configs the tuning
chooses among: row tiles smaller than the rows, K splits (some of them with no K steps) whose
partial sums the last program adds, 64- and 256-wide K steps. Skipped without triton (not a
dependency)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")

from parallel_models.inference.fp8 import decode_gemm_shared, weight_only_kernel  # noqa: E402
from parallel_models.inference.fp8.decode_tuning import DecodeConfig, row_bucket  # noqa: E402
from parallel_models.inference.fp8.gemm import (block_scale_storage,  # noqa: E402
                                                weight_only_matmul)
from parallel_models.inference.fp8.quantize import QuantizedWeight, quantize_weight  # noqa: E402
from parallel_models.inference.fp8.weight_only_kernel import weight_only_mm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter multiplies bf16 blocks in tl.dot as their raw bits: fp32 activations there
# (the kernel converts the weights to the activations' dtype either way)
ACT = torch.bfloat16 if DEV == "cuda" else torch.float32


def _operands(rows, out, inp, granularity):
    g = torch.Generator().manual_seed(rows + out)
    w = torch.randn(out, inp, generator=g)
    x = torch.randn(rows, inp, generator=g).to(DEV, ACT)
    q = quantize_weight(w.to(DEV), granularity)
    if granularity == "block":  # the rollout linears' layout: rows of the scales padded to 4
        storage = block_scale_storage(out, inp, DEV)
        storage.copy_(q.scale)
        q = QuantizedWeight(q.data, storage, granularity)
    return w, x, q


def _check(got, x, q):
    want = weight_only_matmul(x, q).float()
    # the same fp32 sum (rounded to bf16 on the GPU); only the accumulation order differs
    assert got.shape == want.shape
    rtol = 2 ** -7 if ACT == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=rtol * want.abs().max().item())


@pytest.mark.parametrize("granularity", ["block", "channel"])
@pytest.mark.parametrize("rows,out,inp", [(1, 256, 384), (20, 200, 300), (64, 128, 256)])
def test_weight_only_kernel_equals_the_dequantized_product(granularity, rows, out, inp):
    w, x, q = _operands(rows, out, inp, granularity)
    got = weight_only_mm(x, q).float()
    _check(got, x, q)
    # and it is the FP8 weight's product, not the float weight's (the error FP8 adds is there)
    exact = (x.float() @ w.to(DEV).t())
    assert (got - exact).abs().max() > 0


CONFIGS = [  # (rows, out, inp, config): row tiles, K splits (8 splits of 5 K steps: 3 empty), K
    (37, 128, 512, DecodeConfig(32, 16, 64, 2, num_warps=4, num_stages=2)),  # steps of 64 / 256
    (40, 128, 512, DecodeConfig(64, 32, 128, 4, num_warps=4, num_stages=2)),
    (5, 96, 640, DecodeConfig(32, 16, 128, 8, num_warps=4, num_stages=2)),
    (17, 160, 400, DecodeConfig(128, 16, 128, 3, num_warps=4, num_stages=2)),
    (16, 128, 512, DecodeConfig(64, 16, 256, 2, num_warps=4, num_stages=2)),
    (20, 300, 256, DecodeConfig(256, 32, 128, 2, num_warps=4, num_stages=2)),  # 3 block rows
]


@pytest.mark.parametrize("granularity", ["block", "channel"])
@pytest.mark.parametrize("rows,out,inp,cfg", CONFIGS)
def test_tile_configs_and_k_splits(granularity, rows, out, inp, cfg):
    _, x, q = _operands(rows, out, inp, granularity)
    if granularity == "block" and cfg.block_k > 128:
        with pytest.raises(ValueError, match="scale blocks"):
            weight_only_mm(x, q, cfg)
        return
    _check(weight_only_mm(x, q, cfg), x, q)
    if cfg.split_k > 1:  # the last program of each tile reset its counter for the next call
        _, counters = decode_gemm_shared._workspaces[(str(x.device), cfg.split_k,
                                                      row_bucket(rows), out)]
        assert int(counters.abs().sum()) == 0


def test_bit_conversion_constants_give_every_e4m3_value_in_bf16():
    """The GPU kernel's e4m3 -> bf16 step (fp16 words moved into bf16's bit places, then times
    2^112; inline PTX, so not run by the interpreter) with its constants, in torch integer ops on
    pairs of fp16 values packed in 32-bit words: every finite e4m3 code comes out as the value
    torch's own conversion gives, signed zeros and subnormals included."""
    wok = weight_only_kernel
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    want = codes.float()
    halves = codes.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    words = halves[0::2] | halves[1::2] << 16
    moved = (words >> wok.F16_TO_BF16_SHIFT) & wok.F16_TO_BF16_KEEP | words & wok.SIGN_BITS
    pairs = torch.stack([moved & 0xFFFF, moved >> 16], 1).reshape(-1)
    scale = torch.tensor([wok.BF16_TWO_POW_112], dtype=torch.int16).view(torch.bfloat16)
    assert scale.float().item() == 2.0 ** 112
    got = pairs.to(torch.int16).view(torch.bfloat16) * scale  # (bf16 x bf16: exact here)
    finite = ~want.isnan()
    assert torch.equal(got.float()[finite], want[finite])
    assert torch.equal(got.float()[finite].signbit(), want[finite].signbit())
