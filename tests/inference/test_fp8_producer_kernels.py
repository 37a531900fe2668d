"""The FP8 rollout's fused producers (``inference/fp8/producer_kernels.py``: RMSNorm with and
without the residual add, SwiGLU, each writing a per-token e4m3 copy of its output) in Triton's
CPU interpreter (on CUDA where present): the outputs are the eager references' (``fused_ops``),
the copy is ``quantize_activation(output, "channel")`` bit for bit, rows wider than a power of
two, an all-zero row. Skipped without triton (not a dependency)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")

from parallel_models.inference.fp8 import producer_kernels  # noqa: E402
from parallel_models.inference.fp8.quantize import quantize_activation  # noqa: E402
from parallel_models.llama.layers import fused_ops  # noqa: E402
from tests.helpers.triton_interpreter import bf16_rounds_to_nearest_even  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="module")
def _gpu_bf16_rounding():
    with bf16_rounds_to_nearest_even():  # (the interpreter's own conversion drops bits)
        yield


def _rows(rows, cols, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(rows, cols, generator=g)).bfloat16().to(DEV)


def _same_copy(out, copy):
    """The copy is the recipe applied to the kernel's own output, bit for bit."""
    q, s = copy
    q_ref, s_ref = quantize_activation(out, "channel")
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())


def _close_bf16(got, want):
    """Equal, but for a rare last-bit flip on the GPU (rsqrt / exp approximations in fp32)."""
    if DEV == "cpu":
        assert torch.equal(got, want)
        return
    diff = (got.float() - want.float()).abs()
    assert float((diff > 0).float().mean()) < 1e-2
    assert bool((diff <= 2.0 ** -7 * want.float().abs() + 1e-6).all())


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 304), (3, 4096)])
def test_rms_norm_writes_the_eager_output_and_its_e4m3_copy(rows, cols, residual):
    x = _rows(rows, cols, 1, 3.0)
    weight = (1.0 + 0.1 * torch.randn(cols, generator=torch.Generator().manual_seed(2))
              ).bfloat16().to(DEV)
    res = _rows(rows, cols, 3) if residual else None
    if rows > 2:
        x[1] = 0
        if res is not None:
            res[1] = 0  # an all-zero row: rms 0, output 0, scale 1
    total, y, copy = producer_kernels.rms_norm_quantized(x, res, weight, 1e-5)
    if residual:
        want_total, want_y = fused_ops._add_rms_norm(x, res, weight, 1e-5)
        assert torch.equal(total, want_total)
    else:
        assert total is None
        want_y = fused_ops._rms_norm(x, weight, 1e-5)
    _close_bf16(y, want_y)
    _same_copy(y, copy)
    if rows > 2:
        assert float(copy[1][1]) == 1.0 and not copy[0][1].float().any()


@pytest.mark.parametrize("rows,inter", [(1, 64), (4, 300), (2, 14336)])
def test_swiglu_writes_the_eager_output_and_its_e4m3_copy(rows, inter):
    gate_up = _rows(rows, 2 * inter, 4, 2.0)
    y, copy = producer_kernels.swiglu_quantized(gate_up)
    _close_bf16(y, fused_ops._swiglu(gate_up))
    _same_copy(y, copy)


def test_rows_too_wide_for_one_program_are_refused():
    with pytest.raises(ValueError, match="SwiGLU"):
        producer_kernels.swiglu_quantized(torch.zeros(1, 2 * producer_kernels.MAX_COLS + 2,
                                                      dtype=torch.bfloat16, device=DEV))
