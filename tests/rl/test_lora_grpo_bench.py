"""The LoRA-vs-full GRPO bench (``bench/lora_grpo.py``) at a tiny shape on the CPU: one JSON
line per mode, every step logged, the LoRA mode's trainable count is its adapters' (rank 64 on
every linear of 4 layers), and the full mode trains (the trainer runs through the tests'
preloaded forkserver, ``tests/helpers/ppo_runs.run_ppo``, to keep it fast)."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


def _launch(trainer_args, timeout_s):
    from tests.helpers.ppo_runs import run_ppo

    proc = run_ppo(trainer_args, timeout=timeout_s, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def test_tiny_lora_and_full_lines(tmp_path):
    sys.path.insert(0, os.path.abspath(BENCH))
    try:
        import lora_grpo
    finally:
        sys.path.pop(0)
    out = tmp_path / "lines.jsonl"
    lines = lora_grpo.main(["--shape", "tiny", "--steps", "1", "--prompts", "2", "--n", "2",
                            "--prompt-len", "8", "--max-new", "8", "--mini-batch", "4",
                            "--micro-tokens", "64", "--root", str(tmp_path / "root"),
                            "--out", str(out)], launch=_launch)
    assert [json.loads(s) for s in out.read_text().splitlines()] == lines
    lora, full = lines
    assert (lora["mode"], full["mode"]) == ("lora", "full")
    for line in lines:
        assert line["fits"] and line["steps_logged"] == 1, line
        assert line["step_s"] > 0 and line["phases_s"]["train_actor"] > 0
        assert line["steps"][0]["response_length_mean"] == 8  # ignore_eos: every cap reached
    shape = lora_grpo.SHAPES["tiny"]
    h, layers, ffn = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = sum(64 * (i + o) for i, o in [(h, h), (h, kv), (h, kv), (h, h), (h, ffn),
                                               (h, ffn), (ffn, h)])
    assert lora["trainable_params"] == per_layer * layers
    assert full["trainable_params"] is None and full["lora_rank"] is None
