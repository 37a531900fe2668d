"""``parallel_models.console_processes``: a console script's exit code reaches its caller even
when the forkserver that forked it (and reports exit codes) is gone; the CI run of session 21
lost a 14-step PPO run's code so (multiprocessing answered 255 for a run that ended well)."""

import os
import subprocess
import sys

# in a fresh interpreter with a forkserver of its own (no preload): the session's forkserver
# serves the other tests
PROBE = r"""
import multiprocessing as mp, os, signal, sys
from multiprocessing import forkserver
from parallel_models import console_processes, testing

testing._CTX = mp.get_context("forkserver")
flag = sys.argv[1]
ends, killed = (console_processes.start_main("tests.helpers.exit_on_flag:main", [flag, code])
                for code in ("3", "0"))
os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)
os.waitpid(forkserver._forkserver._forkserver_pid, 0)
print("running", ends.poll(), killed.poll())  # orphans now, still running
killed.kill()
print("killed", killed.wait(60))
open(flag, "w").close()
print("ended", ends.wait(60), ends.returncode)
"""


def test_exit_code_survives_the_forkservers_loss(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "flag")], cwd=root,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    # the process that exited says 3 (the forkserver's pipe alone would say 255); the killed
    # one wrote no code: 255, multiprocessing's "cannot tell"
    assert run.stdout.split("\n")[:3] == ["running None None", "killed 255", "ended 3 3"], \
        run.stdout
