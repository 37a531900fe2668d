"""The FP8 decode GEMM probes of session 23 (``bench/fp8_gemm_graph_probe.py``,
``fp8_group_scale_probe.py``, ``fp8_stream_probe.py``) in their ``--tiny`` CPU runs (Triton's
interpreter, no graph): every timing line present, and each experimental kernel's product equal
to the production kernel's, bit for bit, where the probe says it should be. Skipped without
triton (not a dependency)."""

import json
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")

BENCH = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the smoke runs are the CPU interpreter's")


def _run(module_name: str, argv: list, capsys) -> list[dict]:
    sys.path.insert(0, BENCH)
    try:
        module = __import__(module_name)
    finally:
        sys.path.remove(BENCH)
    capsys.readouterr()
    assert module.main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]


def test_graph_probe_times_each_candidate_per_linear(capsys):
    rows = _run("fp8_gemm_graph_probe", ["--tiny", "--linears", "o", "down"], capsys)
    assert all("error" not in r for r in rows)
    assert [(r["linear"], r["scales"]) for r in rows] == \
        [("o", "token")] * 2 + [("down", "token")] * 2 + [("down", "group128")] * 2
    assert all(r["what"] == "tma" and r["us"] > 0 for r in rows)


def test_group_scale_variants_give_todays_bits(capsys):
    rows = _run("fp8_group_scale_probe", ["--tiny"], capsys)
    assert all("error" not in r for r in rows)
    variants = [r["variant"] for r in rows]
    assert variants == ["token", "group", "exp", "exp_defer", "exp_coalesced",
                        "exp_defer_coalesced"] * 2
    assert all(r["max_abs_diff_vs_group"] == 0.0 for r in rows if r["variant"] != "token")


def test_stream_probe_gemms_give_the_production_bits(capsys):
    rows = _run("fp8_stream_probe", ["--tiny"], capsys)
    assert all("error" not in r for r in rows)
    assert [r["variant"] for r in rows] == ["tiles", "tiles+x", "production", "gemm",
                                            "gemm+rot"]
    production, gemm, rotated = rows[2:]
    assert production["max_abs_diff_vs_production"] == gemm["max_abs_diff_vs_production"] == 0.0
    assert rotated["max_abs_diff_vs_production"] <= 1e-3  # (K in another order: fp32 rounding)
