"""``bench/decode_profile.py`` (where a decode step's time goes, by category) on the CPU with a
tiny Llama, bf16-style and with ``--fp8``: every case runs without error, each category the
step launches is labelled (the MLP activation among them: its label follows the MLP's
``gated_activation``), and the FP8 run's GEMM byte floors count one byte per linear weight."""

import json
import os
import subprocess
import sys
import types

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
TINY = ["--device", "cpu", "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "128", "--vocab", "512", "--batches", "4", "--prompt", "8", "--new",
        "16", "--variants", "ours", "--steps", "2"]


def test_fp8_profile_labels_every_category(tmp_path):
    out = tmp_path / "p.json"
    subprocess.run([sys.executable, os.path.join(BENCH, "decode_profile.py"), *TINY, "--fp8",
                    "channel", "--out", str(out)], check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    assert res["errors"] == [] and res["args"]["fp8"] == "channel"
    cats = res["cases"][0]["categories"]
    for cat in ("qkv_gemm", "o_gemm", "gate_up_gemm", "down_gemm", "attention", "norm",
                "activation", "lm_head_gemm"):
        assert cats[cat]["kernels"] > 0 and cats[cat]["us"] > 0, cat


def test_fp8_byte_floors_count_one_byte_per_linear_weight():
    sys.path.insert(0, os.path.abspath(BENCH))
    try:
        import decode_profile
    finally:
        sys.path.pop(0)
    cfg = types.SimpleNamespace(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                vocab_size=512, num_attention_heads=4, num_key_value_heads=2)
    bf16 = decode_profile.byte_floors(cfg, 4, 16, 2)
    fp8 = decode_profile.byte_floors(cfg, 4, 16, 2, linear_bytes=1)
    weights = {"qkv_gemm": 64 * (64 + 2 * 32), "o_gemm": 64 * 64, "gate_up_gemm": 64 * 256,
               "down_gemm": 128 * 64}
    for cat, per_layer in weights.items():
        assert bf16[cat] - fp8[cat] == 2 * per_layer  # 2 layers, one byte less a weight
    assert bf16["lm_head_gemm"] == fp8["lm_head_gemm"]  # (stays in the model dtype)
