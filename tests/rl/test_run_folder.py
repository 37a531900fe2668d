"""One run per output folder (issue 31 items 1-3) and the final export of a finished run
(issue 30 item 9), through ``parallel-models-ppo`` itself."""

import json
import os
import shutil

import pytest

from tests.helpers import trainer_checkpoint_checks as checks
from tests.helpers.ppo_runs import load_folder, run_metrics, run_ppo

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py


def _files(folder):
    return {os.path.relpath(os.path.join(d, f), folder): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, fs in os.walk(folder) for f in fs}


def _error_line(proc):
    lines = [line for line in proc.stderr.strip().splitlines()
             if line.startswith("parallel-models-ppo: error:")]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-2000:])
    return lines[0]


def test_new_run_into_a_run_folder_refuses_unless_overwrite(tmp_path):
    """A second run into a folder holding a run stops before writing anything, naming the folder
    and the choices; --overwrite replaces it (the old run's critic_hf does not survive)."""
    out = str(tmp_path / "run")
    base = [f"trainer.output_dir={out}", "trainer.total_steps=1", "trainer.save_every=1",
            *[a for a in checks.TINY if "save_hf_at_end" not in a]]
    run_ppo(base)
    assert os.path.isdir(os.path.join(out, "critic_hf"))
    before = _files(out)
    grpo = [*base, "algorithm.adv_estimator=grpo"]
    line = _error_line(run_ppo(grpo, check=False))
    for needle in (out, "holds another run", "--resume", "--overwrite", "trainer.output_dir"):
        assert needle in line, (needle, line)
    assert _files(out) == before, "a refused run changed the folder"
    run_ppo([*grpo, "--overwrite"])
    assert not os.path.exists(os.path.join(out, "critic_hf")), "the old run's critic_hf is left"
    assert [m["step"] for m in run_metrics(out)] == [1]
    with open(os.path.join(out, "checkpoints", "step_000001", "trainer_state.json")) as f:
        assert set(json.load(f)["models"]) == {"actor"}


def test_resume_takes_the_run_config_and_refuses_identity_changes(tmp_path):
    """--resume with only trainer.total_steps continues with the run's own settings (the same
    metrics as one uninterrupted run); an override of the reward is refused naming the key."""
    settings = ["rollout.max_new_tokens=6", "data.batch_size=2", "actor.mini_batch_size=4"]
    common = [a for a in checks.TINY if not a.startswith(("rollout.max_new", "data.batch",
                                                          "actor.mini"))]
    ref, out = str(tmp_path / "ref"), str(tmp_path / "run")
    run_ppo([f"trainer.output_dir={ref}", "trainer.total_steps=3", "trainer.save_every=1",
             *common, *settings])
    run_ppo([f"trainer.output_dir={out}", "trainer.total_steps=2", "trainer.save_every=1",
             *common, *settings])
    line = _error_line(run_ppo([f"trainer.output_dir={out}", "--resume",
                                "trainer.total_steps=3", "reward.function=length_reward"],
                               check=False))
    assert "reward.function" in line and "--force-override" in line, line
    run_ppo([f"trainer.output_dir={out}", "--resume", "trainer.total_steps=3"])
    want, got = run_metrics(ref), run_metrics(out)
    assert [m["step"] for m in got] == [1, 2, 3]
    for a, b in zip(want, got):
        for key in a:
            if not key.startswith("timing/"):
                assert a[key] == b[key], f"step {a['step']} {key}: {a[key]} vs {b[key]}"


def test_resume_without_checkpoint_exits_2_and_auto_starts(tmp_path, monkeypatch, capsys):
    from parallel_models.rl import trainer
    from parallel_models.rl.train import main

    seen = []

    class Recorder:  # stands in for PPOTrainer
        def __init__(self, cfg):
            seen.append(cfg)

        def fit(self):
            return []

    monkeypatch.setattr(trainer, "PPOTrainer", Recorder)
    typo = str(tmp_path / "no_such_run")
    assert main(["--resume", f"trainer.output_dir={typo}"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint to resume" in err and typo in err and "--resume=auto" in err
    assert not seen and not os.path.exists(typo)
    assert main(["--resume=auto", f"trainer.output_dir={typo}", "trainer.total_steps=3"]) == 0
    assert len(seen) == 1 and not seen[0].trainer.resume and seen[0].trainer.total_steps == 3


def test_resume_of_a_finished_run_completes_its_export(tmp_path):
    """Killed between the last checkpoint and the end of the export: --resume exports the
    final weights (bit-identical to the uninterrupted run's export)."""
    out = str(tmp_path / "run")
    args = [f"trainer.output_dir={out}", "trainer.total_steps=2", "trainer.save_every=2",
            *[a for a in checks.TINY if "save_hf_at_end" not in a]]
    run_ppo(args)
    want = {d: load_folder(os.path.join(out, d)) for d in ("actor_hf", "critic_hf")}
    shutil.rmtree(os.path.join(out, "critic_hf"))  # the kill came during the critic's export
    record = os.path.join(out, "final_export.json")
    if os.path.exists(record):  # the export had not finished: no record of it
        os.remove(record)
    proc = run_ppo([f"trainer.output_dir={out}", "--resume"])
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["finished"] and summary["exported"], summary
    for d, tensors in want.items():
        got = load_folder(os.path.join(out, d))
        assert got.keys() == tensors.keys()
        assert all((got[k] == v).all() for k, v in tensors.items()), d
    again = run_ppo([f"trainer.output_dir={out}", "--resume"])  # done: nothing more
    assert "exported" not in json.loads(again.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("damage", ["flip", "zero", "truncate"])
def test_checksum_manifest_names_the_damaged_file(tmp_path, damage):
    from parallel_models.llama.checkpoint_utils.checksums import (ChecksumMismatch, verify_manifest,
                                                        write_manifest)

    folder = tmp_path / "step"
    (folder / "dist").mkdir(parents=True)
    data = bytes(range(256)) * 4096
    (folder / "dist" / "__0_0.distcp").write_bytes(data)
    (folder / "trainer_state.json").write_text("{}")
    write_manifest(str(folder))
    assert verify_manifest(str(folder))
    target = folder / "dist" / "__0_0.distcp"
    if damage == "flip":
        raw = bytearray(data)
        raw[123_457] ^= 0x04
        target.write_bytes(bytes(raw))
    elif damage == "zero":
        target.write_bytes(data[:4096] + bytes(len(data) - 4096))
    else:
        target.write_bytes(data[:1000])
    with pytest.raises(ChecksumMismatch) as e:
        verify_manifest(str(folder))
    assert str(target) in str(e.value)
