"""``bench/async_grpo.py`` (sync colocated vs async, issue 35) end to end at a tiny shape on the
CPU: both modes run in one invocation and print one JSON line each with the throughput over
the steps after the warm-up (the GPU run must not be its first run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "async_grpo.py")


def test_tiny_sync_and_async_report_throughput(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, BENCH, "--mode", "both", "--shape", "tiny",
                           "--steps", "3", "--warmup", "1", "--prompts", "4", "--n", "2",
                           "--prompt-len", "8", "--max-new", "8", "--mini-batch", "8",
                           "--micro-tokens", "64", "--stop-share", "0.05", "--partial",
                           "--root", str(tmp_path)],
                          capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["mode"] for r in lines] == ["sync", "async"]
    for r in lines:
        assert r["steps_logged"] == 3 and r["steps_measured"] == 2
        assert len(r["samples_per_s"]["values"]) == 2 and r["samples_per_s"]["median"] > 0
        assert r["tokens_per_s_per_gpu"]["min"] > 0
        assert 1 <= r["response_length_mean"]["median"] <= 8
    assert lines[1]["staleness_max"]["max"] <= 1
