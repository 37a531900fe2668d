"""The FP8 rollout's persistent stream-K decode GEMM (``inference/fp8/stream_k_kernel.py``) in
Triton's CPU interpreter (on CUDA where present) against the emulation it stands for
(``gemm.weight_only_matmul``: ``x @ dequantize(W)^T`` in fp32), for block and channel scales, decode-sized rows, widths that are not multiples of the
tiles, and program counts that cut the strips every way: a strip shared by up to five programs,
programs that span several strips, strips all one program's, a last program with fewer units.
The hand-over's counters are back at 0 after each launch. Skipped without triton (not a
dependency)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")

from parallel_models.inference.fp8 import decode_tuning, stream_k_kernel  # noqa: E402
from parallel_models.inference.fp8.decode_tuning import (DecodeConfig,  # noqa: E402
                                                         candidates, default_config)
from parallel_models.inference.fp8.gemm import (block_scale_storage,  # noqa: E402
                                                weight_only_matmul)
from parallel_models.inference.fp8.quantize import QuantizedWeight, quantize_weight  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ACT = torch.bfloat16 if DEV == "cuda" else torch.float32  # (the interpreter's bf16 dot: bits)


def _operands(rows, out, inp, granularity):
    g = torch.Generator().manual_seed(rows * 7 + out)
    w = torch.randn(out, inp, generator=g)
    x = torch.randn(rows, inp, generator=g).to(DEV, ACT)
    q = quantize_weight(w.to(DEV), granularity)
    if granularity == "block":  # the rollout linears' layout: rows of the scales padded to 4
        storage = block_scale_storage(out, inp, DEV)
        storage.copy_(q.scale)
        q = QuantizedWeight(q.data, storage, granularity)
    return x, q


def _close(got, want):
    assert got.shape == want.shape
    rtol = 2 ** -7 if ACT == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol,
                               atol=rtol * want.float().abs().max().item())


def _counters_zero():
    assert int(stream_k_kernel._counters(torch.device(DEV)).abs().sum()) == 0


# (rows, out, inp, SMs, block_n, programs per SM): 200 x 300 in 64-wide strips is 4 strips x 3
# K steps (the last partial); 132 SMs give one unit a program (every strip 3 programs); 5 SMs:
# 3 units a program (strips all one program's, 4 programs); 7 x 2 programs over 9 strips of 5
# steps: 4 units a program, strips shared by 2; 2 SMs: 6 units, strips spanned
CASES = [
    (1, 200, 300, 132, 64, 1),
    (37, 200, 300, 5, 64, 1),
    (16, 576, 640, 7, 64, 2),
    (64, 256, 512, 2, 128, 1),
    (20, 300, 256, 3, 256, 1),  # 2 strips of 256 rows: scales per weight row (3 block rows)
    (9, 128, 1280, 132, 128, 2),  # one strip of 10 steps over 10 programs
]


@pytest.mark.parametrize("granularity", ["block", "channel"])
@pytest.mark.parametrize("rows,out,inp,sms,block_n,per_sm", CASES)
def test_stream_k_weight_only_equals_the_dequantized_product(monkeypatch, granularity, rows, out,
                                                             inp, sms, block_n, per_sm):
    monkeypatch.setattr(decode_tuning, "sm_count", lambda device: sms)
    x, q = _operands(rows, out, inp, granularity)
    cfg = DecodeConfig(block_n, decode_tuning.row_bucket(rows), 128, 1, num_warps=4,
                       num_stages=2, programs_per_sm=per_sm)
    _close(stream_k_kernel.stream_k_mm(x, q, cfg), weight_only_matmul(x, q))
    _counters_zero()


def test_plan_shares_the_units_evenly_and_bounds_the_contributors():
    cfg = DecodeConfig(128, 64, 128, 1, 8, 4, programs_per_sm=1)
    k_steps, per_program, programs = stream_k_kernel.plan(64, 6144, 4096, cfg, 132)
    assert (k_steps, per_program, programs) == (32, 12, 128)  # 48 strips x 32 steps = 1536
    # two programs per SM, fewer units than programs: one unit each
    assert stream_k_kernel.plan(16, 200, 300, DecodeConfig(64, 16, 128, 1, 4, 2, 2), 132) == \
        (3, 1, 12)
    # the programs' shares tile the units exactly, each within one unit of the others
    for out, inp, sms in [(28672, 4096, 132), (4096, 14336, 132), (6144, 4096, 114)]:
        k_steps, per_program, programs = stream_k_kernel.plan(64, out, inp, cfg, sms)
        units = -(-out // 128) * k_steps
        assert programs <= sms and (programs - 1) * per_program < units <= programs * per_program


def test_stream_k_configs_cover_the_bucket_and_fit_the_shared_memory():
    for kernel in decode_tuning.STREAM_K_KERNELS:
        for rows in (1, 16, 64, 128):
            cfgs = candidates(rows, 4096, 4096, "block", kernel=kernel)
            assert default_config(rows, 4096, 4096, "block", kernel=kernel) in cfgs
            for cfg in cfgs:
                assert cfg.block_m == decode_tuning.row_bucket(rows) and cfg.block_k == 128
                assert cfg.programs_per_sm in (1, 2) and cfg.split_k == 1
                per_program = decode_tuning.SMEM_BYTES // cfg.programs_per_sm
                assert cfg.num_stages * decode_tuning.stage_bytes(
                    cfg.block_n, cfg.block_m, cfg.block_k) <= per_program
    with pytest.raises(ValueError, match="at most 128 rows"):
        default_config(200, 4096, 4096, "block", kernel="stream_k")
    x, q = _operands(3, 128, 128, "channel")
    with pytest.raises(ValueError, match="at most 16 rows"):
        stream_k_kernel.stream_k_mm(torch.cat([x] * 6), q, DecodeConfig(64, 16, 128, 1, 4, 2, 1))
