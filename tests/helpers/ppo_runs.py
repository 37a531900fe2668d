"""Running ``parallel-models-ppo`` in tests (its ``main`` in a process forked from the preloaded
forkserver: ``parallel_models.console_processes.start_main``, one per rank for a multi-rank run; the
console script itself and ``torchrun`` launches: tests/test_cli.py,
tests/distributed/test_multinode.py), and reading what a run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import time

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
MAIN = "parallel_models.rl.train:main"


def start_ppo(args, env=None):
    """``parallel-models-ppo *args`` started (``poll`` / ``kill`` / ``wait`` as a Popen)."""
    from parallel_models.console_processes import start_main

    return start_main(MAIN, list(args), env or ENV)


def run_ppo(args, timeout=300, check=True, env=None):
    """``parallel-models-ppo *args`` to its end: ``returncode``, ``stdout``, ``stderr``; raises
    with the end of stderr when it fails (``check``)."""
    run = start_ppo(args, env)
    try:
        run.wait(timeout)
        proc = subprocess.CompletedProcess(run.args, run.returncode, run.stdout, run.stderr)
    finally:
        run.close()
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def run_ppo_ranks(args, nproc: int, timeout=300, env=None):
    """``torchrun --nproc-per-node nproc -m parallel_models.rl.train *args`` to its end, each
    rank forked from the preloaded forkserver (``parallel_models.console_processes.start_main_ranks``);
    raises with the end of the ranks' stderr when it fails; returns their stderr."""
    from parallel_models.console_processes import start_main_ranks

    run = start_main_ranks(MAIN, list(args), nproc, env or ENV)
    try:
        try:
            code = run.wait(timeout)
        except subprocess.TimeoutExpired:
            run.kill()
            raise
        if code != 0:
            raise AssertionError(f"exit {code}\n{run.stderr[-3000:]}")
        return run.stderr
    finally:
        run.close()


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


def resume_after_kill_matches(tmp_path, common, steps: int) -> None:
    """A run SIGKILLed once its first checkpoint (step 2) exists, then ``--resume``d, logs the
    same metrics (timings aside) at every step as an uninterrupted run of ``common`` (which
    runs meanwhile, on another core where there is one)."""
    ref = str(tmp_path / "ref")
    ref_run = start_ppo([f"trainer.output_dir={ref}", *common])
    try:
        killed = str(tmp_path / "killed")
        proc = start_ppo([f"trainer.output_dir={killed}", *common])
        try:
            deadline = time.time() + 240
            while not os.path.isdir(os.path.join(killed, "checkpoints", "step_000002")):
                assert proc.poll() is None and time.time() < deadline, "no checkpoint appeared"
                time.sleep(0.05)
            proc.kill()  # SIGKILL
            proc.wait()
        finally:
            proc.close()
        run_ppo([f"trainer.output_dir={killed}", *common, "--resume"])
        code = ref_run.wait(300)
        assert code == 0, f"the uninterrupted run: exit {code}\n{ref_run.stderr[-3000:]}"
    finally:
        if ref_run.poll() is None:
            ref_run.kill()
            ref_run.wait()
        ref_run.close()
    want, got = run_metrics(ref), run_metrics(killed)
    assert [m["step"] for m in got] == list(range(1, steps + 1))
    for a, b in zip(want, got):
        for key in a:
            if not key.startswith("timing/"):
                assert a[key] == b[key], f"step {a['step']} {key}: {a[key]} vs {b[key]} after resume"


def assert_same_trainer_state(want_dir, got_dir, adam_steps: float = 2.0) -> None:
    """Two dumps of the trainer's actor and critic (weights, Adam moments, step counts; see
    ``trainer_checkpoint_checks``) are bit-identical."""
    import torch

    for role in ("actor", "critic"):
        for part in ("weights", "exp_avg", "exp_avg_sq"):
            want = load_folder(os.path.join(want_dir, role, part))
            got = load_folder(os.path.join(got_dir, role, part))
            assert want.keys() == got.keys(), f"{role} {part}"
            for k in want:
                assert torch.equal(want[k], got[k]), f"{role} {part} {k} differs after resume"
    with open(os.path.join(want_dir, "adam_steps.json")) as f1, \
            open(os.path.join(got_dir, "adam_steps.json")) as f2:
        assert json.load(f1) == json.load(f2) == {"actor": [adam_steps], "critic": [adam_steps]}
