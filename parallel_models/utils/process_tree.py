"""Stopping a launched process and everything it started, including children that left its
process group.

Why: ``torchrun`` starts each worker in a session of its own (torch's elastic
``SubprocessHandler`` passes ``start_new_session=True``), so ``os.killpg`` on the launcher's
group reaches the launcher but not its ranks. A launcher killed that way leaves its ranks
running, holding their GPUs (measured: a bench's timed-out 8B run kept both GPUs busy through the
next run's measurements). :func:`stop_process_tree` collects the whole tree first (children are
re-parented once their parent dies, so they must be found while it lives), asks politely
(SIGTERM: torchrun forwards it to its workers), and SIGKILLs whatever is still alive after
``grace`` seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil

POLL_S = 0.02


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _signal_all(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:  # (already gone)
            pass


def _running(proc: psutil.Process) -> bool:
    try:  # (a zombie has ended: only its parent, or init once the parent died, can reap it)
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``procs`` still running after at most ``timeout`` seconds (polled)."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(POLL_S)
        alive = [p for p in alive if _running(p)]
    return alive


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_process_tree(proc: subprocess.Popen, grace: float = 10.0, sig: int = signal.SIGTERM
                      ) -> int | None:
    """Stop ``proc``, its process group and every descendant (in any session): ``sig`` to all of
    them, then SIGKILL to those alive after ``grace`` seconds (``grace=0``: SIGKILL at once);
    waits until they are gone. Returns ``proc``'s exit code. (``proc`` itself is reaped by
    ``Popen``, never by psutil, so its exit code stays known.)"""
    others = _descendants(proc.pid)
    if grace > 0:
        _signal_group(proc, sig)
        _signal_all(others, sig)
        deadline = time.monotonic() + grace
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        others = _wait_gone(others, max(0.0, deadline - time.monotonic()))
        others += [p for p in _descendants(proc.pid) if p not in others]
    _signal_group(proc, signal.SIGKILL)
    _signal_all(others, signal.SIGKILL)
    _wait_gone(others, 30)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        return proc.returncode


__all__ = ["stop_process_tree"]
