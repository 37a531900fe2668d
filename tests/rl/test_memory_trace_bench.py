"""``bench/memory_trace.py``: live allocations grouped by the code that made them (our innermost
frame and its caller; CUDA graph pools tagged), the per-step line with what grew, and the
launcher running its module (off CUDA it records nothing)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "memory_trace.py")
spec = importlib.util.spec_from_file_location("memory_trace_bench", BENCH)
trace = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace)

MIB = 2 ** 20


def _frame(path, line, name):
    return {"filename": path, "line": line, "name": name}


OURS_ALLOC = [_frame("/x/site-packages/torch/nn/functional.py", 10, "linear"),
              _frame("/repo/parallel_models/inference/continuous.py", 200, "_prefill"),
              _frame("/repo/parallel_models/inference/engine.py", 270, "_generate_continuous"),
              _frame("/repo/parallel_models/rl/trainer.py", 210, "step")]
THEIRS_ALLOC = [_frame("/x/site-packages/torch/optim/adam.py", 5, "step"),
                _frame("/x/site-packages/megatron/core/optimizer/optimizer.py", 40, "step")]


def _snapshot(prefill_mib: int, graph_mib: int) -> dict:
    block = lambda size, frames, state="active_allocated": {  # noqa: E731
        "size": size, "requested_size": size - 7, "state": state, "frames": frames}
    return {"segments": [
        {"segment_pool_id": (0, 0), "blocks": [
            block(prefill_mib * MIB, OURS_ALLOC), block(3 * MIB, OURS_ALLOC),
            block(50 * MIB, THEIRS_ALLOC), block(900 * MIB, OURS_ALLOC, "inactive")]},
        {"segment_pool_id": (0, 3), "blocks": [block(graph_mib * MIB, OURS_ALLOC)]}]}


def test_groups_by_our_innermost_frame_and_its_caller_with_graph_pools_apart():
    groups = trace.live_groups(_snapshot(128, 64))
    ours = ("parallel_models/inference/continuous.py:200:_prefill <- "
            "parallel_models/inference/engine.py:270:_generate_continuous")
    theirs = "optimizer.py:40:step"  # (no frame of ours: the innermost outside torch)
    graph = ours + " [private pool: a CUDA graph's]"
    assert groups == {ours: [131 * MIB, 2], theirs: [50 * MIB, 1], graph: [64 * MIB, 1]}
    assert trace.where([]) == "(no Python frame)"


def test_step_line_ranks_groups_and_names_what_grew():
    first = trace.live_groups(_snapshot(128, 64))
    second = trace.live_groups(_snapshot(256, 64))
    line = trace.step_line(2, second, first)
    assert line["step"] == 2 and line["live_gib"] == round((259 + 50 + 64) / 1024, 4)
    assert [g[0] for g in line["groups"]][0].startswith("parallel_models/inference/continuous")
    assert line["grew"] == [[line["groups"][0][0], 0.125]]  # only the prefill group grew
    assert trace.step_line(1, first, None)["grew"] == []
    json.dumps(line)  # (a JSON line)


def test_launcher_runs_the_module_and_refuses_a_bad_command_line(tmp_path):
    ok = subprocess.run([sys.executable, BENCH, "--out", str(tmp_path / "t"), "-m", "platform"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
    bad = subprocess.run([sys.executable, BENCH, "--out", str(tmp_path), "platform"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "usage: memory_trace.py" in bad.stderr
