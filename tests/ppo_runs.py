"""Running ``parallel-models-ppo`` as a subprocess in tests, and reading what a run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
PPO = [sys.executable, "-m", "parallel_models.rl.train"]


def run_ppo(args, timeout=300, check=True, env=None):
    """``parallel-models-ppo *args``; raises with the end of stderr when it fails (``check``)."""
    proc = subprocess.run(PPO + list(args), env=env or ENV, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_metrics(output_dir):
    """The records of a run's metrics.jsonl."""
    return read_jsonl(os.path.join(output_dir, "metrics.jsonl"))


def load_folder(folder):
    """Every tensor of an HF folder's safetensors files."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out
