"""The README's runnable examples run as pasted (2 gloo ranks on the CPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py


def test_pipeline_example_trains(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--nproc-per-node", "2", "examples/pipeline_train.py",
                           "--steps", "3", "--model", str(tmp_path / "model")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # no third-party warning a user cannot act on (13 UserWarnings before: megatron-core's notes
    # about the optional GPU extras, torch deprecations)
    assert not re.search(r"Warning\b|warnings\.warn", proc.stderr), proc.stderr[-3000:]
    assert "pp_rank 1 chunk 0: layers 2-3 norm+head" in proc.stdout
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], proc.stdout


def test_readme_commands_use_the_venv_tools():
    """Multi-rank commands in the README name .venv/bin/torchrun (a bare torchrun is not on PATH
    in a fresh clone), and the pipeline example they point to exists."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    bare = [line for line in text.splitlines()
            if re.search(r"(^|[\s`])torchrun\b", line) and ".venv/bin/torchrun" not in line]
    assert not bare, bare
    assert "examples/pipeline_train.py" in text
