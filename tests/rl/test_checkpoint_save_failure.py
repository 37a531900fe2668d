"""A checkpoint save that fails part-way (issue 30 item 12: a full disk): one clean line naming
the file and what to do, exit code 2, no temporary folder left, the previous checkpoint intact."""

import os
import subprocess

from parallel_models.console_processes import start_main
from tests.helpers import trainer_checkpoint_checks as checks
from tests.helpers.ppo_runs import ENV


def test_save_that_runs_out_of_space_fails_cleanly(tmp_path):
    out = str(tmp_path / "run")
    # 1 MB: the built-in model (~0.3 MB), metrics and logs fit; a checkpoint (~2 MB) does not
    run = start_main("tests.helpers.file_size_limit:main",
                     [str(1 << 20), f"trainer.output_dir={out}", "trainer.total_steps=2",
                      "trainer.save_every=1", *checks.TINY], ENV)
    try:
        run.wait(300)
        proc = subprocess.CompletedProcess(run.args, run.returncode, run.stdout, run.stderr)
    finally:
        run.close()
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "[rank0]" not in proc.stderr
    line = errors[0]
    for needle in ("step_000001", "File too large", "Nothing was saved", "--resume"):
        assert needle in line, (needle, line)
    assert os.path.join(out, "checkpoints") in line  # names where it was writing
    root = os.path.join(out, "checkpoints")
    assert not os.path.exists(root) or os.listdir(root) == [], os.listdir(root)
