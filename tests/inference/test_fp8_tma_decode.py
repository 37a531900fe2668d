"""The FP8 rollout's TMA W8A8 decode GEMM (``inference/fp8/tma_decode_kernel.py``) in Triton's CPU
interpreter (on CUDA where present) against ``gemm.token_matmul`` (activations quantized per
token, ``_scaled_mm``'s row-wise recipe, times the dequantized channel-scaled weight): tiles
larger than the product, partial K steps, K splits (the partial sums' hand-over), row tiles;
the e4m3 copy a producer leaves on its output is the one the kernel reads; products it does not
take (block scales, rows not 16-byte aligned) go to the weight-only kernel. Skipped without
triton (not a dependency)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")

from parallel_models.inference.fp8 import gemm, tma_decode_kernel  # noqa: E402
from parallel_models.inference.fp8.decode_tuning import DecodeConfig  # noqa: E402
from parallel_models.inference.fp8.quantize import QUANTIZED_COPY, quantize_weight  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ACT = torch.bfloat16 if DEV == "cuda" else torch.float32  # (the interpreter: fp32 dots)


def _operands(rows, out, inp, granularity="channel", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inp, generator=g).to(DEV, ACT)
    q = quantize_weight((0.02 * torch.randn(out, inp, generator=g)).to(DEV), granularity)
    return x, q


def _close(got, want):
    tol = 2.0 ** -7 * (want.abs() + want.abs().max() * 2.0 ** -4) + 1e-6
    return bool(((got.float() - want.float()).abs() <= tol).all())


@pytest.mark.parametrize("rows,out,inp,cfg", [
    (37, 200, 304, DecodeConfig(64, 64, 128, 1, 4, 2)),   # tiles past the rows, outputs, K
    (37, 200, 304, DecodeConfig(64, 16, 128, 2, 4, 3)),   # row tiles, a K split, partial step
    (5, 96, 512, DecodeConfig(32, 16, 256, 2, 4, 2)),     # 256-wide steps, two splits
    (1, 64, 1024, DecodeConfig(64, 16, 128, 4, 4, 2)),    # one row, four splits
    # the decode rows the MMA's long side: strips past the outputs, rows past the tile
    (37, 200, 304, DecodeConfig(16, 64, 128, 1, 4, 2, tokens_first=True)),
    (70, 96, 512, DecodeConfig(32, 64, 256, 2, 4, 2, tokens_first=True)),  # 2 row tiles, split
    # strips of several power-of-two parts (128 + 64 + 32; 32 + 16), the last strip partial
    (37, 300, 304, DecodeConfig(224, 64, 128, 1, 4, 2, tokens_first=True)),
    (70, 200, 512, DecodeConfig(48, 64, 256, 1, 4, 2, tokens_first=True)),
])
def test_kernel_matches_the_row_wise_recipe(rows, out, inp, cfg):
    x, q = _operands(rows, out, inp)
    y = torch.empty(rows, out, dtype=x.dtype, device=DEV)
    got = tma_decode_kernel.launch(x, q, y, cfg)
    want = gemm.token_matmul(x, q)
    assert _close(got, want)
    # and not the weight-only product (the activations' e4m3 rounding is in it)
    assert not torch.equal(got, gemm.weight_only_matmul(x, q))


def test_the_producers_e4m3_copy_is_what_the_kernel_reads():
    x, q = _operands(16, 128, 256, seed=1)
    cfg = DecodeConfig(64, 16, 128, 1, 4, 2)
    y = torch.empty(16, 128, dtype=x.dtype, device=DEV)
    # a copy of other activations left on x: the kernel must multiply those
    other = torch.randn(16, 256, generator=torch.Generator().manual_seed(9)).to(DEV, ACT)
    setattr(x, QUANTIZED_COPY, tma_decode_kernel.quantize_tokens(other))
    assert _close(tma_decode_kernel.launch(x, q, y, cfg), gemm.token_matmul(other, q))
    # a copy of another shape is not used
    setattr(x, QUANTIZED_COPY, tma_decode_kernel.quantize_tokens(other[:8]))
    assert _close(tma_decode_kernel.launch(x, q, y, cfg), gemm.token_matmul(x, q))


def test_products_it_does_not_take_run_the_weight_only_kernel():
    x, q = _operands(4, 256, 256, granularity="block")
    assert not tma_decode_kernel.supports(x, q)
    with pytest.raises(ValueError, match="channel scales"):
        tma_decode_kernel.launch(x, q, torch.empty(4, 256, dtype=x.dtype, device=DEV),
                                 DecodeConfig(64, 16, 128, 1, 4, 2))
    assert _close(tma_decode_kernel.tma_mm(x, q, DecodeConfig(64, 16, 128, 1, 4, 2)),
                  gemm.weight_only_matmul(x, q))
    x, q = _operands(4, 64, 200)  # 200 inputs: TMA rows must be 16-byte aligned
    assert not tma_decode_kernel.supports(x, q)
    assert _close(tma_decode_kernel.tma_mm(x, q), gemm.weight_only_matmul(x, q))


def test_a_strip_of_parts_gets_a_descriptor_each_and_no_k_split():
    cfg = DecodeConfig(224, 64, 128, 1, 4, 2, tokens_first=True)
    assert tma_decode_kernel.descriptor_blocks(cfg) == [(128, 128), (64, 128), (32, 128),
                                                        (128, 128)]
    assert tma_decode_kernel.part_constexprs(cfg) == {"BLOCK_N": 128, "PARTS": 3, "BN2": 64,
                                                      "BN3": 32, "BN4": 16, "STRIP": 224}
    x, q = _operands(4, 448, 256)
    with pytest.raises(ValueError, match="no K split"):  # (one counter per program)
        tma_decode_kernel.launch(x, q, torch.empty(4, 448, dtype=x.dtype, device=DEV),
                                 DecodeConfig(224, 64, 128, 2, 4, 2, tokens_first=True))


@pytest.mark.parametrize("cfg", [
    DecodeConfig(64, 16, 256, 2, 4, 2),                       # two groups a K step, K split
    DecodeConfig(16, 64, 128, 1, 4, 2, tokens_first=True),    # tokens first
    DecodeConfig(48, 64, 128, 1, 4, 2, tokens_first=True),    # a strip of parts: per token
])
def test_group_scaled_copy_is_multiplied_group_by_group(cfg):
    """A copy with scales per token and 128 inputs (the fused gate_up + SwiGLU kernel's) is
    multiplied as such: ``gemm.dynamic_matmul``'s recipe; a config whose K step or strip does
    not take groups quantizes the activations per token instead."""
    from parallel_models.inference.fp8.quantize import quantize_activation

    x, q = _operands(37, 200, 640, seed=3)
    other = torch.randn(37, 640, generator=torch.Generator().manual_seed(4)).to(DEV, ACT)
    xq, xs = quantize_activation(other, "block")
    setattr(x, QUANTIZED_COPY, (xq, xs.contiguous()))
    y = torch.empty(37, 200, dtype=x.dtype, device=DEV)
    got = tma_decode_kernel.launch(x, q, y, cfg)
    if tma_decode_kernel.strip_of_parts(cfg):
        assert _close(got, gemm.token_matmul(x, q))
    else:
        assert _close(got, gemm.dynamic_matmul(other, q))
        assert not _close(got, gemm.token_matmul(other, q))


@pytest.mark.parametrize("cfg", [
    DecodeConfig(128, 64, 128, 1, 8, 3),                      # weight rows first: 2 lines a row
    DecodeConfig(16, 64, 256, 1, 4, 3, tokens_first=True),    # o_proj's strips: 16 lines a row
    DecodeConfig(32, 64, 128, 2, 4, 3, tokens_first=True),    # a K split
])
def test_weight_prefetch_before_the_wait_changes_nothing(monkeypatch, cfg):
    """Where dependent launch is on (Hopper), a program asks L2 for its first weight lines
    before it waits (``dependent_launch.prefetch_weights``): the product is the one without,
    bit for bit (group-scaled copy too)."""
    from parallel_models.inference.fp8 import dependent_launch as dl

    if not dl.enabled(torch.device(DEV)):
        pytest.skip("no dependent launch here (Hopper GPUs only): nothing is prefetched")
    assert dl.prefetch_lines(torch.device(DEV), cfg.block_n, 1024) > 0
    x, q = _operands(64, 384, 1024, seed=5)
    for copy in (None, "block"):
        if copy:
            from parallel_models.inference.fp8.quantize import quantize_activation

            setattr(x, QUANTIZED_COPY, tuple(t.contiguous() for t in
                                             quantize_activation(x, copy)))
        monkeypatch.delenv(dl.PREFETCH_ENV, raising=False)
        with_prefetch = tma_decode_kernel.launch(x, q, torch.empty(64, 384, dtype=ACT,
                                                                   device=DEV), cfg)
        monkeypatch.setenv(dl.PREFETCH_ENV, "0")
        without = tma_decode_kernel.launch(x, q, torch.empty(64, 384, dtype=ACT, device=DEV),
                                           cfg)
        assert torch.equal(with_prefetch, without)
        assert _close(with_prefetch, gemm.token_matmul(x, q) if copy is None else
                      gemm.dynamic_matmul(x, q))


@pytest.mark.parametrize("cfg", [DecodeConfig(128, 64, 128, 1, 8, 3),
                                 DecodeConfig(32, 64, 256, 2, 4, 3, tokens_first=True)])
def test_promotion_setting_keeps_the_product(monkeypatch, cfg):
    """``PARALLEL_MODELS_FP8_PROMOTE``: 0 (the default) never promotes the FP8 MMA's sums (on
    Hopper the tensor cores accumulate all of K), 128 promotes them to fp32 every 128 inputs (in
    the interpreter the dot is fp32 either way); both give the row-wise recipe's product within
    its tolerance. Any other value is refused, naming the variable."""
    monkeypatch.delenv(tma_decode_kernel.PROMOTE_ENV, raising=False)
    assert tma_decode_kernel.promote_every() == 0
    x, q = _operands(64, 384, 1024, seed=6)
    for value in ("128", "0"):
        monkeypatch.setenv(tma_decode_kernel.PROMOTE_ENV, value)
        assert tma_decode_kernel.promote_every() == int(value)
        got = tma_decode_kernel.launch(x, q, torch.empty(64, 384, dtype=ACT, device=DEV), cfg)
        assert _close(got, gemm.token_matmul(x, q))
    monkeypatch.setenv(tma_decode_kernel.PROMOTE_ENV, "64")
    with pytest.raises(ValueError, match="PARALLEL_MODELS_FP8_PROMOTE"):
        tma_decode_kernel.promote_every()
