"""The main job says only what a user can act on (issue 31 item 9): no third-party warning on a
fresh run, on a resume, or on a multi-rank CPU run under torchrun (megatron's
CUDA_DEVICE_MAX_CONNECTIONS advice, torch's ShardedTensor deprecation from the CPU shim), and
rank 0 logs (one "resumed" line, not one per rank). The pipeline example: tests/test_examples.py.
Also issue 31 item 8: user prompts that the built-in tokenizer rewrites (lowercase, accents) are
named in one warning."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from parallel_models.distributed import free_port
from tests.helpers.ppo_runs import ENV, run_ppo

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["trainer.save_hf_at_end=false", "trainer.loggers=[jsonl]", "data.batch_size=4",
         "rollout.max_new_tokens=8", "trainer.save_every=1"]
WARNING = re.compile(r"\b[A-Za-z]*Warning\b|^WARNING\b|warnings\.warn")
pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py


def warning_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` that are (or carry) a warning."""
    return [line for line in stderr.splitlines() if WARNING.search(line)]


def test_main_job_fresh_resume_and_torchrun_print_no_warnings(tmp_path):
    out = str(tmp_path / "run")
    fresh = run_ppo([f"trainer.output_dir={out}", "trainer.total_steps=1", *QUICK])
    assert warning_lines(fresh.stderr) == [], fresh.stderr[-3000:]
    resumed = run_ppo([f"trainer.output_dir={out}", "trainer.total_steps=2", *QUICK, "--resume"])
    assert warning_lines(resumed.stderr) == [], resumed.stderr[-3000:]
    assert len(re.findall(r"\bresumed from\b", resumed.stderr)) == 1, resumed.stderr[-3000:]
    # two ranks, TP=2 with sequence parallelism, resumed at that layout
    env = {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, ENV.get("PYTHONPATH")]))}
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    proc = subprocess.run(
        [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), "-m",
         "parallel_models.rl.train", f"trainer.output_dir={out}", "trainer.total_steps=3",
         "parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true", *QUICK,
         "--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert warning_lines(proc.stderr) == [], proc.stderr[-3000:]
    assert len(re.findall(r"\bresumed from\b", proc.stderr)) == 1, proc.stderr[-3000:]


def test_builtin_tokenizer_names_the_prompts_it_rewrites(tmp_path):
    from parallel_models.tokenizer import builtin_tokenizer_note

    assert builtin_tokenizer_note(["count to five:", "name a color"], "x.jsonl") is None
    note = builtin_tokenizer_note(["Say Hello", "café", "plain"], "x.jsonl")
    assert note.startswith("x.jsonl: the built-in character tokenizer lowercases") and \
        "2 of 3 prompts" in note and "'Say Hello' -> 'say hello'" in note and "model.path" in note
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(f'{{"prompt": "Name A Color {i}:"}}\n' for i in range(8)))
    proc = run_ppo([f"trainer.output_dir={tmp_path / 'out'}", f"data.path={data}",
                    "trainer.total_steps=1", *QUICK])
    warned = warning_lines(proc.stderr)
    assert len(warned) == 1 and "8 of 8 prompts" in warned[0], proc.stderr[-3000:]
