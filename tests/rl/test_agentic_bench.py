"""The agentic rollout bench (``bench/agentic_rollout.py``, the lead runs it on the GPU) in its
``--tiny`` CPU mode: every case runs 3 turns with one tool call each, the slow-tool cases spend
the tool time, and every case generates the same tokens (the bench's throughput ratio compares
like with like); the asynchronous driver's re-entries prefill only the new tokens (fewer prefill
tokens than the turn-synchronous driver's whole conversations), and the counts are reported. The
bench runs as ``python bench/agentic_rollout.py --tiny`` would, in a process forked from the
preloaded forkserver (tests/helpers/forked_script.py)."""

from __future__ import annotations

import json
import os

from parallel_models.console_processes import start_main
from tests.helpers.forked_script import TARGET

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "agentic_rollout.py")


def test_tiny_bench_reports_the_same_tokens_in_every_case(tmp_path):
    out = tmp_path / "r.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    from parallel_models.rl.agents.async_turns import REENTRY_WAIT_STEPS

    default = str(REENTRY_WAIT_STEPS)
    proc = start_main(TARGET, [BENCH, "--tiny", "--sweep-wait-steps", "0", default, "--out",
                               str(out)], env)
    try:
        assert proc.wait(300) == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    finally:
        proc.close()
    result = json.loads(out.read_text())
    cases = result["cases"]
    # --sweep-wait-steps: the default gathering is the tools case, 0 one more case
    assert set(cases) == {"no_latency", "no_latency_turn_synchronous", "tools",
                          "tools_turn_synchronous", "tools_wait0"}
    assert set(result["ratio_by_wait_steps"]) == {"0", default}
    assert result["ratio_by_wait_steps"][default] == result["throughput_ratio"]
    assert result["same_work"] and result["same_tokens"]
    assert result["baseline"] in ("no_latency", "no_latency_turn_synchronous")
    for case in cases.values():
        assert case["prefill_calls"] >= 1 and case["decode_steps"] >= 8
    per_row, synchronous = cases["tools"], cases["tools_turn_synchronous"]
    assert per_row["prefill_tokens"] == cases["no_latency"]["prefill_tokens"]
    assert per_row["prefill_tokens"] < synchronous["prefill_tokens"]
    tokens = {c["model_tokens"] for c in cases.values()}
    assert len(tokens) == 1 and tokens.pop() >= 8 * 3 * 4  # turns of >= 4 tokens
    for case in cases.values():
        assert case["turns_mean"] == 3.0 and case["tool_calls_mean"] == 3.0
    # 8 conversations x 3 calls of 50 ms
    assert cases["tools"]["tool_time_s"] >= 24 * 0.05 * 0.95
    assert cases["no_latency"]["tool_time_s"] < 0.5
    for case in cases.values():  # where a run's time went
        assert case["decode_s"] > 0 and case["prefill_s"] > 0
        assert case["decode_s"] + case["prefill_s"] + case["idle_on_tools_s"] \
            <= case["seconds_max"] * 1.01
    # the last conversations wait on their 50 ms tools with nothing left to decode
    assert cases["tools"]["idle_on_tools_s"] > 0.02
    assert cases["tools_turn_synchronous"]["idle_on_tools_s"] >= 3 * 0.05 * 0.95
    assert result["throughput_ratio"] > 0
