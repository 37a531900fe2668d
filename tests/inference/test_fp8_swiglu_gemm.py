"""The FP8 rollout's fused gate_up + SwiGLU decode kernel (``inference/fp8/swiglu_gemm_kernel.py``)
in Triton's CPU interpreter (on CUDA where present): its output against SwiGLU of
``gemm.token_matmul`` (the TMA GEMM's recipe) on the ``[gate; up]`` weight, its e4m3 copy
against ``quantize_activation(., "block")`` of that output bit for bit, every tuning candidate
and both MMA operand orders, and the down GEMM reading the copy group by group. Skipped without
triton (not a dependency)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")

from parallel_models.inference.fp8 import decode_tuning, gemm, swiglu_gemm_kernel  # noqa: E402
from parallel_models.inference.fp8.decode_tuning import DecodeConfig  # noqa: E402
from parallel_models.inference.fp8.quantize import (QUANTIZED_COPY,  # noqa: E402
                                                    dequantize_activation, quantize_activation,
                                                    quantize_weight)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ACT = torch.bfloat16 if DEV == "cuda" else torch.float32  # (the interpreter: fp32 dots)


def _operands(rows, inter, inp, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inp, generator=g).to(DEV, ACT)
    w = quantize_weight((0.05 * torch.randn(2 * inter, inp, generator=g)).to(DEV), "channel")
    return x, w


def _swiglu_reference(x, w):
    gate, up = gemm.token_matmul(x, w).float().chunk(2, dim=-1)
    silu = (gate / (1.0 + torch.exp(-gate))).to(x.dtype).float()
    return (silu * up).to(x.dtype)


def _close(got, want, rel=2.0 ** -7):
    tol = rel * (want.abs() + want.abs().max() * 2.0 ** -4) + 1e-6
    return bool(((got.float() - want.float()).abs() <= tol).all())


def _swiglu_close(got, want):
    """Within SwiGLU's propagation of a GEMM output's last-bit difference (the accumulation
    order; bf16 on CUDA): ``silu``'s relative slope ``1 + g (1 - sigmoid(g))`` reaches ~4 at
    ``g = -5``, so 2^-5 relative, where a wrong kernel is off by order 1."""
    return _close(got, want, rel=2.0 ** -5 if got.dtype == torch.bfloat16 else 2.0 ** -7)


def _group_matmul(x, weight, group):
    """``x`` quantized per token and ``group`` inputs, dequantized, times ``dequantize(W)^T``
    (``gemm.dynamic_matmul``'s recipe for any group), in fp32 cast to ``x``'s dtype."""
    xq, xs = quantize_activation(x.float(), "block", group=group)
    x_deq = dequantize_activation(xq, xs, "block", group=group)
    return (x_deq @ weight.dequantize(torch.float32).t()).to(x.dtype)


@pytest.mark.parametrize("rows,cfg", [
    (37, DecodeConfig(128, 64, 128, 1, 8, 2)),                     # rows past the tile
    (70, DecodeConfig(128, 64, 256, 1, 4, 2, tokens_first=True)),  # two row tiles, tokens first
    (5, DecodeConfig(128, 16, 128, 1, 4, 2)),                      # a small bucket
    (37, DecodeConfig(64, 64, 128, 1, 4, 2)),                      # 64-feature groups
    (70, DecodeConfig(64, 64, 256, 1, 4, 2, tokens_first=True)),
])
def test_output_and_its_group_scaled_copy(rows, cfg):
    x, w = _operands(rows, 256, 384)
    h = swiglu_gemm_kernel.gate_up_swiglu(x, w, cfg)
    assert h.shape == (rows, 256) and h.dtype == x.dtype
    assert _swiglu_close(h, _swiglu_reference(x, w))
    q, s = getattr(h, QUANTIZED_COPY)
    want_q, want_s = quantize_activation(h, "block", group=cfg.block_n)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    # the down GEMM multiplies the copy group by group (128: gemm.dynamic_matmul's recipe)
    down = quantize_weight((0.05 * torch.randn(96, 256)).to(DEV), "channel")
    from parallel_models.inference.fp8 import tma_decode_kernel
    y = tma_decode_kernel.tma_mm(h, down, DecodeConfig(32, 64, 128, 1, 4, 2))
    assert _close(y, _group_matmul(h, down, cfg.block_n))
    if cfg.block_n == 128:
        assert _close(y, gemm.dynamic_matmul(h, down))
    assert not _close(y, gemm.token_matmul(h, down))


def test_the_norms_copy_is_what_it_multiplies_and_the_candidates_agree():
    x, w = _operands(16, 128, 256, seed=2)
    other = torch.randn(16, 256, generator=torch.Generator().manual_seed(5)).to(DEV, ACT)
    from parallel_models.inference.fp8 import tma_decode_kernel
    setattr(x, QUANTIZED_COPY, tma_decode_kernel.quantize_tokens(other))
    want = _swiglu_reference(other, w)
    for cfg in decode_tuning.candidates(16, 256, 256, "channel", kernel="tma_swiglu"):
        assert _swiglu_close(swiglu_gemm_kernel.gate_up_swiglu(x, w, cfg), want), cfg


def test_what_it_does_not_take():
    x, w = _operands(4, 192, 256)  # an intermediate size of 1.5 groups
    assert not swiglu_gemm_kernel.supports(x, w)
    with pytest.raises(ValueError, match="multiples of 128"):
        swiglu_gemm_kernel.gate_up_swiglu(x, w, DecodeConfig(128, 16, 128, 1, 4, 2))
    x, w = _operands(4, 128, 256)
    with pytest.raises(ValueError, match="features a program"):
        swiglu_gemm_kernel.gate_up_swiglu(x, w, DecodeConfig(32, 16, 128, 1, 4, 2))


def test_dependent_launch_is_on_only_where_it_can_be(monkeypatch):
    """``dependent_launch.launch_options``: PDL on a CUDA device of SM 9.0+, off on the CPU, in
    the interpreter, with ``PARALLEL_MODELS_FP8_PDL=0`` and while the tuner times candidates
    (``decode_tuning.timing``)."""
    from parallel_models.inference.fp8 import dependent_launch as dl

    if dl.gdc_wait is None:
        pytest.skip("a triton without griddepcontrol")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(dl, "_device_supports", lambda index: index == 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(dl.ENV, raising=False)
    assert dl.launch_options(cuda) == {"PDL": True, "launch_pdl": True}
    assert dl.launch_options(torch.device("cuda", 1)) == {"PDL": False}  # (SM < 9.0 here)
    assert dl.launch_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(decode_tuning, "_timing", True)
    assert dl.launch_options(cuda) == {"PDL": False}
    monkeypatch.setattr(decode_tuning, "_timing", False)
    monkeypatch.setenv(dl.ENV, "0")
    assert dl.launch_options(cuda) == {"PDL": False}
    monkeypatch.delenv(dl.ENV)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dl.launch_options(cuda) == {"PDL": False}


def test_weight_prefetch_sizes_and_switches(monkeypatch):
    """``dependent_launch.prefetch_lines``: a power of two of 128-byte lines a weight row that
    keeps a program within ``PARALLEL_MODELS_FP8_PREFETCH_KB`` (at least one, at most the
    program's K range); none where PDL is off or the variable is 0. The attention's dependent
    launch has its own switch."""
    from parallel_models.inference.fp8 import dependent_launch as dl

    if dl.gdc_wait is None:
        pytest.skip("a triton without griddepcontrol")
    assert dl.lines_for(32 << 10, 256, 4096) == 1      # the 8B qkv tile: a line a row
    assert dl.lines_for(32 << 10, 16, 4096) == 16      # o_proj's 16-row strips
    assert dl.lines_for(32 << 10, 32, 512) == 4        # at most the program's K range
    assert dl.lines_for(32 << 10, 48, 4096) == 4       # 5.3 lines -> 4 (a power of two)
    assert dl.lines_for(1 << 10, 256, 4096) == 1       # at least one
    assert dl.lines_for(0, 16, 4096) == 0
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(dl, "_device_supports", lambda index: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for var in (dl.ENV, dl.ATTENTION_ENV, dl.PREFETCH_ENV):
        monkeypatch.delenv(var, raising=False)
    assert dl.prefetch_lines(cuda, 16, 4096) == dl.lines_for(dl.PREFETCH_KB << 10, 16, 4096)
    monkeypatch.setenv(dl.PREFETCH_ENV, "8")
    assert dl.prefetch_lines(cuda, 16, 4096) == 4
    monkeypatch.setenv(dl.PREFETCH_ENV, "0")
    assert dl.prefetch_lines(cuda, 16, 4096) == 0
    monkeypatch.delenv(dl.PREFETCH_ENV)
    monkeypatch.setenv(dl.ATTENTION_ENV, "0")  # the attention's switch leaves the GEMMs on
    assert dl.launch_options(cuda, dl.ATTENTION_ENV) == {"PDL": False}
    assert dl.launch_options(cuda)["PDL"] and dl.prefetch_lines(cuda, 16, 4096) > 0
    monkeypatch.setenv(dl.ENV, "0")
    assert dl.prefetch_lines(cuda, 16, 4096) == 0
    assert dl.launch_options(torch.device("cpu")) == {"PDL": False}
    assert dl.prefetch_lines(torch.device("cpu"), 16, 4096) == 0


def test_weight_prefetch_before_the_wait_changes_nothing(monkeypatch):
    """Where dependent launch is on (Hopper), each program asks L2 for the first lines of its
    gate and up rows before it waits: output and copy are the ones without, bit for bit."""
    from parallel_models.inference.fp8 import dependent_launch as dl

    if not dl.enabled(torch.device(DEV)):
        pytest.skip("no dependent launch here (Hopper GPUs only): nothing is prefetched")
    x, w = _operands(64, 256, 1024, seed=2)
    cfg = DecodeConfig(128, 64, 128, 1, 4, 3, tokens_first=True)
    monkeypatch.delenv(dl.PREFETCH_ENV, raising=False)
    h = swiglu_gemm_kernel.gate_up_swiglu(x, w, cfg)
    monkeypatch.setenv(dl.PREFETCH_ENV, "0")
    h0 = swiglu_gemm_kernel.gate_up_swiglu(x, w, cfg)
    assert torch.equal(h, h0)
    for a, b in zip(getattr(h, QUANTIZED_COPY), getattr(h0, QUANTIZED_COPY)):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b)
