"""The 8B-scale GRPO bench (``bench/grpo_scale.py``) end to end at a tiny shape on 2 CPU ranks,
TP=2 and PP=2: it builds its model, tokenizer and capped prompts, the trainer runs every step,
and the report counts the tokens the caps imply (the GPU run must not be its first run); the
PPO + critic variant with per-role options and response caps drawn between given bounds; the
long-responses preset fills only the options left at their defaults."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

from tests.helpers.forked_torchrun import ForkingSubprocess

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "grpo_scale.py")


def _run_bench(tmp_path, monkeypatch, capsys, args: list) -> tuple[dict, str]:
    """The bench's ``main`` in this process with ``args``, its torchrun launches as forked ranks
    (tests/helpers/forked_torchrun.py: the imports of fresh interpreters saved) -> (its
    ``--out`` JSON, its stdout)."""
    spec = importlib.util.spec_from_file_location("grpo_scale_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "subprocess", ForkingSubprocess())
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)  # main sets it
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", [BENCH, *args, "--root", str(tmp_path / "root"),
                                      "--out", str(out)])
    try:
        bench.main()
        code = 0
    except SystemExit as err:
        code = err.code
    proc = capsys.readouterr()
    assert code in (0, None), proc.out[-2000:] + proc.err[-3000:]
    return json.loads(out.read_text()), proc.out


def test_tiny_tp2_and_pp2_runs_report_every_phase(tmp_path, monkeypatch, capsys):
    result, _ = _run_bench(tmp_path, monkeypatch, capsys, [
        "--shape", "tiny", "--layout", "tp2", "pp2", "--steps", "2", "--prompts", "4",
        "--n", "2", "--prompt-len", "16", "--max-new", "8", "--mini-batch", "8",
        "--micro-tokens", "64"])
    assert [r["layout"] for r in result["runs"]] == ["tp2", "pp2"]
    for run in result["runs"]:
        assert len(run["steps"]) == 2
        # the host memory of the run's process tree (two ranks, each over 100 MiB resident)
        assert 0.2 < run["host_rss_peak_gib"] < run["host_total_gib"]
        assert 0 < run["host_available_min_gib"] < run["host_total_gib"]
        for step in run["steps"]:
            # 4 prompts x 2 samples, 16 prompt tokens + 8 new (ignore_eos: every cap is reached)
            assert step["tokens"] == 8 * (16 + 8) and step["response_tokens"] == 8 * 8
            assert step["response_length_mean_logged"] == 8
            assert {"gen", "score", "train_actor"} <= set(step["phases"])
            assert step["phases"]["score"]["tokens_per_s_per_gpu"] > 0
            assert step["nemo_rl_tokens_per_s_per_gpu"] > 0


def _case_lines(stdout: str) -> list[dict]:
    return [json.loads(x) for x in stdout.splitlines() if x.startswith('{"case"')]


def test_tiny_ppo_critic_variant_with_bounded_response_caps(tmp_path, monkeypatch, capsys):
    result, stdout = _run_bench(tmp_path, monkeypatch, capsys, [
        "--shape", "tiny", "--layout", "pp2", "--critic", "--steps", "1", "--prompts", "4",
        "--n", "2", "--prompt-len", "8", "--max-new", "16", "--response-min", "12",
        "--response-median", "14", "--mini-batch", "8", "--micro-tokens", "64",
        "--actor", "recompute=full", "--critic-opt", "recompute=selective",
        "use_distributed_optimizer=true"])
    caps = result["response_caps"]
    assert 12 <= caps["min"] <= caps["max"] <= 16
    (step,) = result["runs"][0]["steps"]
    assert step["response_tokens"] > 8 * 12 - 1 and {"train_actor", "train_critic"} <= set(
        step["phases"])
    (line,) = _case_lines(stdout)
    assert line["case"] == "tiny-pp2-ppo_critic" and line["returncode"] == 0
    assert "peak_gib" in line["phases"][0]["train_critic"]


def test_long_responses_preset_fills_defaults_only():
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("grpo_scale", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    p = argparse.ArgumentParser()
    for flag, default in (("--shape", "8b"), ("--max-new", 1024), ("--response-min", 16)):
        p.add_argument(flag, default=default, type=type(default))
    for key in ("prompts", "n", "prompt_len", "response_median", "mini_batch", "micro_tokens",
                "timeout"):
        p.add_argument(f"--{key.replace('_', '-')}", default=None)
    p.add_argument("--preset", default=None)
    args = p.parse_args(["--preset", "long-responses", "--shape", "0.5b"])
    bench.apply_preset(args, p)
    assert args.shape == "0.5b" and args.max_new == 16384 and args.response_min == 8192
    assert args.micro_tokens >= args.prompt_len + args.max_new


def test_report_from_a_kept_metrics_file(tmp_path, monkeypatch, capsys):
    """``--from-metrics``: the report of the 8B PPO + LoRA-critic run (2x H200, session 16) from
    its ``metrics.jsonl`` in bench/results, with the data rebuilt: the figures
    docs/PERFORMANCE.md quotes."""
    kept = os.path.join(os.path.dirname(BENCH), "results",
                        "ppo_critic_tp2_8b_2026-11-27.metrics.jsonl")
    spec = importlib.util.spec_from_file_location("grpo_scale_report_run", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", [BENCH, "--layout", "tp2", "--critic", "--steps", "5",
                                      "--from-metrics", kept, "--out", str(out)])
    bench.main()
    (line,) = _case_lines(capsys.readouterr().out)
    assert line["case"] == "8b-tp2-ppo_critic" and line["steps"] == 5
    assert round(line["median_step_s"], 1) == 166.5  # steps 2-5: 175.1, 170.0, 163.1, 149.0
    assert [round(x) for x in line["spread_step_s"]] == [149, 175]
    timed = sorted(line["nemo_rl_tokens_per_s_per_gpu"][1:])
    assert [round(timed[0]), round((timed[1] + timed[2]) / 2), round(timed[-1])] == [1284, 1359,
                                                                                   1480]
    step5 = json.loads(out.read_text())["runs"][0]["steps"][-1]
    assert step5["response_tokens"] == 178928 and step5["tokens"] == 441072
    assert round(step5["phases"]["gen"]["peak_gib"], 1) == 66.7
