"""The FP8 rollout's weight-only decode GEMM (``inference/fp8/weight_only_kernel.py``: e4m3
weights, 16-bit activations) in Triton's CPU interpreter (on CUDA where present) against the
emulation it stands for (``gemm.weight_only_matmul``: ``x @ dequantize(W)^T`` in fp32), for
block and channel scales, decode-sized row counts, widths that are not multiples of the tiles,
and the scale layout the rollout linears keep (rows padded to 4). Skipped without triton (not
a dependency)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")

from parallel_models.inference.fp8.gemm import (block_scale_storage,  # noqa: E402
                                                weight_only_matmul)
from parallel_models.inference.fp8.quantize import QuantizedWeight, quantize_weight  # noqa: E402
from parallel_models.inference.fp8.weight_only_kernel import weight_only_mm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter multiplies bf16 blocks in tl.dot as their raw bits: fp32 activations there
# (the kernel converts the weights to the activations' dtype either way)
ACT = torch.bfloat16 if DEV == "cuda" else torch.float32


@pytest.mark.parametrize("granularity", ["block", "channel"])
@pytest.mark.parametrize("rows,out,inp", [(1, 256, 384), (20, 200, 300), (64, 128, 256)])
def test_weight_only_kernel_equals_the_dequantized_product(granularity, rows, out, inp):
    g = torch.Generator().manual_seed(rows + out)
    w = torch.randn(out, inp, generator=g)
    x = torch.randn(rows, inp, generator=g).to(DEV, ACT)
    q = quantize_weight(w.to(DEV), granularity)
    if granularity == "block":  # the rollout linears' layout: rows of the scales padded to 4
        storage = block_scale_storage(out, inp, DEV)
        storage.copy_(q.scale)
        q = QuantizedWeight(q.data, storage, granularity)
    got = weight_only_mm(x, q).float()
    want = weight_only_matmul(x, q).float()
    # the same fp32 sum (rounded to bf16 on the GPU); only the accumulation order differs
    assert got.shape == (rows, out)
    rtol = 2 ** -7 if ACT == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item())
    # and it is the FP8 weight's product, not the float weight's (the error FP8 adds is there)
    exact = (x.float() @ w.to(DEV).t())
    assert (got - exact).abs().max() > 0
