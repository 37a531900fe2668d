"""The FP8 decode GEMM sweep (``bench/fp8_gemm_sweep.py --tiny``) in Triton's CPU interpreter:
one JSON line per (linear, rows) with bf16 and, for each of our two decode kernels, its times
for each config timed, the chosen config among them, its result equal to the kernel's emulation
(the dequantized product; the activations quantized first for the W8A8 kernel), and the ``best``
(per kernel) and ``layer`` summary lines. Skipped without triton (not a dependency)."""

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
    # block scales for every kernel but the channel-only TMA one, then channel scales for all
    assert [(c["scales"], c["rows"]) for c in cases] == [("block", 1), ("block", 16),
                                                         ("channel", 1), ("channel", 16)]
    kernels = {"block": ("dynamic", "w8a8", "weight_only"),
               "channel": ("dynamic", "w8a8", "weight_only", "tma")}
    for c in cases:
        assert (c["n"], c["k"]) == (256, 256) and c["bf16_us"] > 0
        assert ("tma" in c) == (c["scales"] == "channel")
        for kernel in kernels[c["scales"]]:
            k = c[kernel]
            assert k["us"] > 0 and k["gbps"] > 0 and k["over_bf16"] == k["us"] / c["bf16_us"]
            assert len(k["configs"]) == 2 and all(cfg["us"] > 0 for cfg in k["configs"])
            assert any(cfg["split_k"] == 2 for cfg in k["configs"])
            chosen = {f: v for f, v in k["configs"][0].items() if f not in ("us", "gbps")}
            assert k["config"] == chosen  # the CPU takes the default, untimed
            assert k["max_rel_err"] < 1e-5  # fp32 in the interpreter
            assert c[kernel]["configs"][0]["block_k"] % 128 == 0 or kernel == "weight_only"
        if "tma" in c:
            assert c["tma"]["quantize_us"] > 0  # (timed apart: the GEMM reads a ready copy)
    best = [line for line in lines if "best" in line]
    assert sorted((b["best"]["scales"], b["best"]["kernel"]) for b in best) == sorted(
        (scales, kernel) for scales, ks in kernels.items() for kernel in ks)
    for b in best:
        assert b["best"]["row_bucket"] == 16
        assert b["us"] == min(cfg["us"] for c in cases if c["scales"] == b["best"]["scales"]
                              for cfg in c[b["best"]["kernel"]]["configs"])
    layers = [line for line in lines if "layer" in line]
    assert [(line["layer"]["scales"], line["layer"]["rows"]) for line in layers] == \
        [(c["scales"], c["rows"]) for c in cases]
    for line in layers:
        for kernel in kernels[line["layer"]["scales"]]:
            assert line[f"{kernel}_over_bf16"] == line[f"{kernel}_us"] / line["bf16_us"]
