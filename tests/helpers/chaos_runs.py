"""The chaos test of the trainer (issue 30): SIGKILL ``parallel-models-ppo`` at seeded random
fault points (``parallel_models/utils/fault_points.py``) - in start-up, mid-step, inside
checkpoint saves, inside the final HF export - and restart it with ``--resume=auto`` each time;
the run must end as if it was never interrupted. Each kill is the process killing itself at the
named point (``PARALLEL_MODELS_TEST_FAULT``), so every kill lands in its window however loaded
the machine is: no polling, no sleeps, no timing."""

from __future__ import annotations

import json
import os
import random

from parallel_models.utils.fault_points import ENV as FAULT_ENV, POINTS
from tests.helpers.ppo_runs import ENV, load_folder, run_metrics, run_ppo, start_ppo

# kills while the run has steps left: every start-up, step and checkpoint-save point
MID_RUN = tuple(p for p in POINTS if p.split(":")[0] in ("start", "step", "save"))
# kills once every step is saved: the final export's points (save_pretrained: 1 actor, 2 critic)
EXPORT = ("export:start", "hf_save:before_publish@1", "hf_save:before_publish@2",
          "export:before_record")


def _latest_step(out: str) -> int:
    try:
        with open(os.path.join(out, "checkpoints", "latest")) as f:
            return int(json.load(f)["step"])
    except FileNotFoundError:
        return 0


def _kill_at(out: str, common: list[str], spec: str) -> None:
    """One ``--resume=auto`` run that must die of SIGKILL at the fault point ``spec``."""
    proc = start_ppo([f"trainer.output_dir={out}", *common, "--resume=auto"],
                     env={**ENV, FAULT_ENV: spec})
    try:
        code = proc.wait(300)
        said = f"fault point {spec}: SIGKILL" in proc.stderr
        assert code == -9 and said, f"{spec}: exit {code}, not killed there\n{proc.stderr[-3000:]}"
    finally:
        proc.close()


def _kill_and_resume(out: str, common: list[str], steps: int, seed: int) -> list[str]:
    """The kills of :func:`chaos_resume_matches` and the last resume; returns the kills."""
    rng = random.Random(seed)
    made: list[str] = []
    for point in rng.sample(MID_RUN, len(MID_RUN)):
        latest = _latest_step(out)
        second = steps - latest >= 4 and not point.startswith("start:")
        made.append(f"{point}@{rng.choice((1, 2)) if second else 1}")
        _kill_at(out, common, made[-1])
        assert _latest_step(out) >= latest, f"{made}: latest went back from step {latest}"
        assert _latest_step(out) < steps, f"{made}: no step left for the next kill"
    for spec in rng.sample(EXPORT, len(EXPORT)):
        made.append(spec if "@" in spec else f"{spec}@1")
        _kill_at(out, common, made[-1])
        assert _latest_step(out) == steps, made
        assert not os.path.exists(os.path.join(out, "final_export.json")), made
    proc = run_ppo([f"trainer.output_dir={out}", *common, "--resume=auto"])
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["finished"] and summary.get("exported"), summary
    return made


def chaos_resume_matches(tmp_path, common: list[str], steps: int, seed: int) -> dict:
    """A kill at every start-up, step and save point (in a seeded random order, each at its
    first or, while >= 4 steps are left, a seeded random first or second hit), then at every
    point of the final export (seeded order), each followed by ``--resume=auto``; then one last
    ``--resume=auto``. Its metrics (timings aside) and final HF exports equal an uninterrupted
    run's. ``common`` must save every step and export at the end (with a critic), and ``steps``
    must leave a step for each mid-run kill. The uninterrupted run goes on meanwhile (the runs
    use one thread each: on a 2-core machine it takes the other core). Returns the folders and
    the kills made."""
    ref, out = str(tmp_path / "ref"), str(tmp_path / "chaos")
    reference = start_ppo([f"trainer.output_dir={ref}", *common])  # runs beside the kills
    try:
        made = _kill_and_resume(out, common, steps, seed)
        code = reference.wait(600)
        assert code == 0, f"the uninterrupted run: exit {code}\n{reference.stderr[-3000:]}"
    finally:
        if reference.poll() is None:  # a failed kill: do not leave it running
            reference.kill()
            reference.wait()
        reference.close()
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
    leftovers = [n for n in os.listdir(out) + os.listdir(os.path.join(out, "checkpoints"))
                 if ".tmp" in n]
    assert not leftovers, f"temporary folders left after the kills {made}: {leftovers}"
    return {"ref": ref, "out": out, "kills": made}
