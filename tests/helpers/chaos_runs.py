"""The chaos test of the trainer (issue 30): SIGKILL ``parallel-models-ppo`` at seeded random
moments - while it starts, mid-step, during a checkpoint save, in the final export window - and
restart it with ``--resume=auto`` each time; the run must end as if it was never interrupted."""

from __future__ import annotations

import glob
import json
import os
import random
import time

from tests.helpers.ppo_runs import load_folder, run_metrics, run_ppo, start_ppo


def _latest_step(out: str) -> int:
    try:
        with open(os.path.join(out, "checkpoints", "latest")) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError):
        return 0


def _has_step(out: str, step: int) -> bool:
    try:
        return any(m["step"] == step for m in run_metrics(out))
    except (OSError, ValueError):
        return False


def _trigger(kind: str, out: str, start: int, rng: random.Random):
    """A function: True once the moment to kill has come."""
    if kind == "start":  # anywhere in start-up or the first step
        deadline = time.time() + rng.uniform(0.0, 3.0)
        return lambda: time.time() >= deadline
    if kind == "save":  # a checkpoint save in progress (its hidden temporary folder exists)
        return lambda: bool(glob.glob(os.path.join(out, "checkpoints", ".step_*.tmp-*")))
    if kind == "step":  # a random moment after the next step's metrics
        wait, seen = rng.uniform(0.0, 0.4), []

        def step_done():
            if not seen and _has_step(out, start + 1):
                seen.append(time.time())
            return bool(seen) and time.time() >= seen[0] + wait
        return step_done
    # "export:N": after step N's checkpoint, while the plot and actor_hf / critic_hf are
    # written (at a random moment, or as a new hidden folder of the export appears)
    final, wait, seen = int(kind.split(":")[1]), rng.uniform(0.0, 0.05), []
    folder = rng.choice([None, "actor_hf", "critic_hf"])
    pattern = os.path.join(out, f".{folder}.tmp-*")
    old = set(glob.glob(pattern))

    def exporting():
        if folder is not None:
            return bool(set(glob.glob(pattern)) - old)
        if not seen and _latest_step(out) >= final:
            seen.append(time.time())
        return bool(seen) and time.time() >= seen[0] + wait
    return exporting


def chaos_resume_matches(tmp_path, common: list[str], steps: int, kills: int, seed: int) -> dict:
    """``kills`` SIGKILLs of a ``steps``-step run at seeded random moments, each followed by
    ``--resume=auto``; its metrics (timings aside) and final HF exports equal an uninterrupted
    run's. Returns the folders and the kinds of kills made."""
    ref, out = str(tmp_path / "ref"), str(tmp_path / "chaos")
    run_ppo([f"trainer.output_dir={ref}", *common])
    rng = random.Random(seed)
    made: list[str] = []
    for _ in range(4 * kills):
        start = _latest_step(out)
        if start >= steps - 1:  # only the last save and the export are left: make sure
            # a save was hit once (the kinds drawn before may all have been start / step)
            kind = "save" if "save" not in made else f"export:{steps}"
        else:
            kind = rng.choices(["start", "step", "save"], weights=[1, 2, 2])[0]
        fire = _trigger(kind, out, start, rng)
        proc = start_ppo([f"trainer.output_dir={out}", *common, "--resume=auto"])
        try:
            deadline = time.time() + 120
            while proc.poll() is None and not fire():
                assert time.time() < deadline, f"{kind}: the run neither ended nor got there"
                time.sleep(0.002)
            if proc.poll() is None:
                proc.kill()  # SIGKILL
                made.append(kind.split(":")[0])
            proc.wait()
            assert proc.returncode in (0, -9), proc.stderr[-3000:]
        finally:
            proc.close()
        if (len(made) >= kills and "export" in made) or os.path.isfile(
                os.path.join(out, "final_export.json")):
            break
    if not os.path.isfile(os.path.join(out, "final_export.json")):
        run_ppo([f"trainer.output_dir={out}", *common, "--resume=auto"])
    # the kinds hit depend on timing (a tiny save can finish between two polls): at least two
    # kills must land; exactness below is the point
    assert len(made) >= 2, f"kills: {made}"
    want, got = run_metrics(ref), run_metrics(out)
    assert [m["step"] for m in got] == list(range(1, steps + 1)), [m["step"] for m in got]
    for a, b in zip(want, got):
        for key in a:
            if not key.startswith("timing/"):
                assert a[key] == b[key], f"step {a['step']} {key}: {a[key]} vs {b[key]} ({made})"
    for folder in ("actor_hf", "critic_hf"):
        w, g = load_folder(os.path.join(ref, folder)), load_folder(os.path.join(out, folder))
        assert w.keys() == g.keys() and all((w[k] == g[k]).all() for k in w), \
            f"{folder} differs after the kills {made}"
    return {"ref": ref, "out": out, "kills": made}
