"""The FP8 decode GEMM sweep (``bench/fp8_gemm_sweep.py --tiny``) in Triton's CPU interpreter:
one JSON line per (linear, rows) with bf16 and our kernel's times for each config timed, the
chosen config among them, its result equal to the dequantized product, and the ``best`` and
``layer`` summary lines. Skipped without triton (not a dependency)."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the CPU interpreter's")
def test_tiny_sweep_lines():
    sys.path.insert(0, os.path.abspath(BENCH))
    try:
        import fp8_gemm_sweep
    finally:
        sys.path.pop(0)
    lines = fp8_gemm_sweep.main(["--tiny", "--device", "cpu"])
    cases = [line for line in lines if "linear" in line]
    assert [c["rows"] for c in cases] == [1, 16]
    for c in cases:
        assert (c["n"], c["k"], c["scales"]) == (256, 256, "block")
        assert c["bf16_us"] > 0 and c["fp8_us"] > 0 and c["fp8_gbps"] > 0
        assert len(c["configs"]) == 2 and all(cfg["us"] > 0 for cfg in c["configs"])
        assert any(cfg["split_k"] == 2 for cfg in c["configs"])
        chosen = {f: v for f, v in c["configs"][0].items() if f not in ("us", "gbps")}
        assert c["config"] == chosen  # the CPU takes the default, untimed
        assert c["max_rel_err"] < 1e-5  # fp32 in the interpreter
    best = [line for line in lines if "best" in line]
    assert len(best) == 1 and best[0]["best"]["row_bucket"] == 16
    assert best[0]["us"] == min(cfg["us"] for c in cases for cfg in c["configs"])
    layers = [line for line in lines if "layer" in line]
    assert [line["layer"]["rows"] for line in layers] == [1, 16]
