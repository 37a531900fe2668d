"""``utils.process_tree.stop_process_tree`` reaches children that left the launcher's process group
(as torchrun's workers do), which ``os.killpg`` alone does not."""

import os
import signal
import subprocess
import sys

import psutil
import pytest

from parallel_models.utils.process_tree import stop_process_tree

# a launcher that starts a worker in a session of its own (as torch's elastic agent does), prints
# the worker's pid and waits (longer than the worker); argv[1] == 1: the launcher ignores SIGTERM
LAUNCHER = """
import signal, subprocess, sys, time
if sys.argv[1] == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
w = subprocess.Popen(["sleep", "120"], start_new_session=True)
print(w.pid, flush=True)
w.wait()
time.sleep(120)  # (outlives its worker)
"""


def _launch(ignore_term: bool):
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, "1" if ignore_term else "0"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    worker = int(proc.stdout.readline())
    return proc, psutil.Process(worker)


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_killpg_alone_leaves_the_worker_running():
    proc, worker = _launch(ignore_term=False)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert worker.is_running() and not _gone(worker)  # the bug the helper exists for
    finally:
        worker.kill()
        proc.stdout.close()


@pytest.mark.parametrize("grace,ignore_term", [(0, False), (5.0, False), (0.3, True)])
def test_stop_process_tree_stops_workers_in_other_sessions(grace, ignore_term):
    proc, worker = _launch(ignore_term)
    try:
        code = stop_process_tree(proc, grace=grace)
        assert code is not None and proc.poll() is not None
        assert _gone(worker)  # (stop_process_tree waited until it ended)
        if ignore_term:  # the launcher outlived SIGTERM: killed after the grace
            assert code == -signal.SIGKILL
    finally:
        if not _gone(worker):
            worker.kill()
        proc.stdout.close()


def test_stop_process_tree_of_an_ended_process():
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait(30)
    assert stop_process_tree(proc, grace=1.0) == 0
