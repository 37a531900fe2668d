"""The decode probes of session 23 (``bench/fp8_gemm_graph_probe.py``,
``fp8_group_scale_probe.py``, ``fp8_stream_probe.py``) in their ``--tiny`` CPU runs (Triton's
interpreter, no graph): every timing line present, and each experimental kernel's product equal
to the production kernel's, bit for bit, where the probe says it should be; and
``split_kv_resources.py``'s sm_90 compile. Skipped without triton (not a dependency)."""

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


def test_graph_probe_promotion_settings_and_errors(capsys):
    """``--promote 128 0`` times each config twice (the interpreter's dot is fp32 either way)
    with its error against fp64 arithmetic on the same e4m3 values and scales: fp32 rounding
    (the SwiGLU output: the dtype's rounding too, fp32 on the CPU)."""
    rows = _run("fp8_gemm_graph_probe", ["--tiny", "--linears", "gate_up", "down", "--promote",
                                         "128", "0", "--candidates", "0"], capsys)
    assert [(r["linear"], r["scales"], r["promote"]) for r in rows] == [
        ("gate_up", "token", 128), ("gate_up", "token", 0), ("down", "token", 128),
        ("down", "token", 0), ("down", "group128", 128), ("down", "group128", 0)]
    assert all(0 < r["max_err"] < 1e-5 and 0 < r["mean_err"] < 1e-5 for r in rows)
    assert os.environ.get("PARALLEL_MODELS_FP8_PROMOTE") is None  # (the probe restores it)


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


def test_split_kv_resources_reports_one_line_per_config():
    """``bench/split_kv_resources.py``: the split-KV kernel compiled for sm_90 (no GPU; in a
    process of its own, triton not imported for the interpreter), registers, spills and shared
    memory per launch config."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, os.path.join(BENCH, "split_kv_resources.py"),
                          "--configs", "32,4,2", "--rope", "off"], env=env,
                         capture_output=True, text=True, timeout=240)
    if "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip("triton without its bundled ptxas")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1
    row = rows[0]
    assert (row["block_n"], row["num_warps"], row["rope"]) == (32, 4, False)
    assert row["registers"] > 0 and row["shared"] > 0 and row["spill_bytes"] is not None


def test_wave_probe_times_reads_and_the_fused_kernel_per_program_count(capsys):
    """``bench/fp8_wave_probe.py``: the read by each grid, then the fused gate_up + SwiGLU
    kernel per program count (``PxS``: S K steps), each at the tuned depth and the extra ones."""
    rows = _run("fp8_wave_probe", ["--tiny", "--stages", "2"], capsys)
    assert all("error" not in r for r in rows)
    assert [(r["what"], r["programs"]) for r in rows] == \
        [("read", 2), ("read", 3)] + [("tma_swiglu", 2)] * 2 + [("tma_swiglu", 3)] * 2
    fused = [r for r in rows if r["what"] == "tma_swiglu"]
    assert [r["k"] for r in fused] == [256, 256, 128, 128]  # (the tiny hidden size; 3x1)
    assert [r["tiles"]["num_stages"] for r in fused][1::2] == [2, 2]
    assert all(r["us"] > 0 for r in rows)


def test_norm_probe_gives_the_same_bits_at_every_warp_count(capsys):
    """``bench/fp8_norm_probe.py``: the RMSNorm + e4m3 copy kernel per warp count, its outputs
    equal to the first warp count's."""
    rows = _run("fp8_norm_probe", ["--tiny"], capsys)
    assert [r["warps"] for r in rows] == [4, 8]
    assert all(r["max_abs_diff"] == 0.0 and r["us"] > 0 for r in rows)
