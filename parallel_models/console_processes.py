"""Console scripts run in processes forked from the testing forkserver (tests and examples):
``start_main("pkg.module:main", argv)`` runs a script's ``main`` as ``python -m`` would, without
paying torch / megatron-core / transformers imports again (a subprocess-like handle,
:class:`MainProcess`); ``start_main_ranks`` one such process per rank, as
``torchrun --nproc-per-node`` would start them (:class:`MainRanks`)."""

from __future__ import annotations

import os
import time
import traceback

from parallel_models.testing import _context


def _main_process(target: str, argv: list, env: dict, out_path: str, err_path: str,
                  new_session: bool = False, process_group: int | None = None,
                  status_path: str | None = None) -> None:
    """A console script's ``main(argv)`` as ``python -m`` would run it, in a forked process:
    the caller's environment (``PYTHONWARNINGS`` applied), stdout / stderr to files (one file
    when both paths are the same), in a session of its own when ``new_session`` (as
    ``Popen(start_new_session=True)``) or in the process group ``process_group`` (0: a new one
    it leads), the exit code from its return value or ``SystemExit``, an uncaught exception's
    traceback on stderr and code 1, then what the interpreter's exit does: join non-daemon
    threads, run the atexit handlers; last, the exit code into ``status_path`` (see
    :class:`MainProcess`)."""
    import atexit
    import importlib
    import sys
    import warnings

    if new_session:
        os.setsid()
    elif process_group is not None:
        deadline = time.monotonic() + 30
        while True:  # the group's leader may not have made it yet
            try:
                os.setpgid(0, process_group)
                break
            except PermissionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONWARNINGS"):
        warnings._processoptions(env["PYTHONWARNINGS"].split(","))
    for fds, path in (((1, 2), out_path),) if out_path == err_path else \
            (((1,), out_path), ((2,), err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        for fd in fds:
            os.dup2(f, fd)
        os.close(f)
    module, name = target.split(":")
    try:
        code = getattr(importlib.import_module(module), name)(list(argv))
    except SystemExit as err:
        code = err.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    import threading

    for t in threading.enumerate():  # interpreter shutdown: non-daemon threads, then atexit
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if status_path is not None:
        with open(status_path + ".tmp", "w") as f:
            f.write(str(code % 256 if isinstance(code, int) else int(code is not None)))
        os.replace(status_path + ".tmp", status_path)
    sys.exit(code or 0)


def _poll_until(poll, deadline: float | None):
    """``poll()`` every 50 ms until it gives an exit code or ``time.monotonic()`` passes
    ``deadline`` (None: no deadline) -> the code, or None at the deadline."""
    while (code := poll()) is None and (deadline is None or time.monotonic() < deadline):
        time.sleep(0.05)
    return code


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has: it waits to be reaped;
    Linux's /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class MainProcess:
    """A console script's ``main`` (``"package.module:main"``) started by :func:`start_main`;
    ``poll`` / ``wait`` / ``kill`` / ``returncode`` / ``stdout`` / ``stderr`` as in
    ``subprocess``. The forkserver reports the exit code; where it is gone (it reports 255
    then, at once, even for a process still running), the code comes from the one the process
    wrote last into its status file, once it has ended."""

    LOST = 255  # multiprocessing's exit code when the forkserver that forked it cannot tell

    def __init__(self, target: str, argv: list, env: dict, log_dir: str | None,
                 log_path: str | None = None, new_session: bool = False,
                 process_group: int | None = None):
        import tempfile

        self.args = [target, *argv]
        self._dir = tempfile.mkdtemp(prefix="main_", dir=log_dir)
        self._paths = [log_path] * 2 if log_path else \
            [os.path.join(self._dir, n) for n in ("stdout", "stderr")]
        self._status = os.path.join(self._dir, "exitcode")
        self._proc = _context().Process(target=_main_process,
                                        args=(target, list(argv), dict(env), *self._paths,
                                              new_session, process_group, self._status))
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self):
        return self.poll()

    def poll(self):
        code = self._proc.exitcode
        if code != self.LOST:
            return code
        try:
            with open(self._status) as f:
                return int(f.read())
        except (OSError, ValueError):
            pass
        # no record: still running (an orphan now), or it died without writing one
        return None if process_running(self.pid) else code

    def kill(self) -> None:
        import signal

        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the exit; on ``timeout`` kills it and raises ``subprocess.TimeoutExpired``."""
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        self._proc.join(timeout)
        code = _poll_until(self.poll, deadline)  # (a loop only when the forkserver is gone)
        if code is None:
            self.kill()
            self._proc.join()
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def _read(self, i: int) -> str:
        with open(self._paths[i], errors="replace") as f:
            return f.read()

    @property
    def stdout(self) -> str:
        return self._read(0)

    @property
    def stderr(self) -> str:
        return self._read(1)

    def close(self) -> None:
        """Remove its status file and the files that held its stdout / stderr (not a
        ``log_path`` of the caller's)."""
        import shutil

        shutil.rmtree(self._dir, ignore_errors=True)


def start_main(target: str, argv: list, env: dict | None = None, log_dir: str | None = None,
               *, log_path: str | None = None, new_session: bool = False,
               process_group: int | None = None) -> MainProcess:
    """Start ``main(argv)`` of ``target`` (``"package.module:main"``) in a process forked from
    the forkserver that holds torch / megatron-core / transformers imported: the same run as
    ``python -m package.module *argv`` without paying those imports again (seconds of CPU).
    ``log_path``: stdout and stderr both into that file (else two temporary files, read back
    by ``stdout`` / ``stderr``); ``new_session``: the process leads a process group of its own
    (``os.killpg(handle.pid, ...)`` reaches it, as after ``Popen(start_new_session=True)``);
    ``process_group``: it joins that process group (0: a new one it leads)."""
    return MainProcess(target, argv, dict(os.environ if env is None else env), log_dir,
                       log_path, new_session, process_group)


# what torchrun sets for a rank (dropped from an inherited environment)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GROUP_RANK")


class MainRanks:
    """Console-script ranks started by :func:`start_main_ranks` (or one per rank by the caller)
    as one Popen-like handle (``pid``: rank 0's, the leader of their process group). Like
    torchrun, a rank that fails takes the others down and the exit code is the first nonzero
    one; ``stdout`` / ``stderr``: every rank's, rank 0 first."""

    def __init__(self, ranks: list):
        self.ranks = ranks
        self.pid = ranks[0].pid
        self.args = ranks[0].args

    def poll(self):
        codes = [r.poll() for r in self.ranks]
        failed = [c for c in codes if c not in (None, 0)]
        if failed and None in codes:
            self.kill()
            for r in self.ranks:
                r.wait()
            codes = [r.poll() for r in self.ranks]
        if None in codes:
            return None
        return next((c for c in codes if c != 0), 0)

    @property
    def returncode(self):
        return self.poll()

    def kill(self) -> None:
        import signal

        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None = None) -> int:
        """Waits for every rank; on ``timeout`` raises ``subprocess.TimeoutExpired``."""
        import subprocess

        code = _poll_until(self.poll, None if timeout is None else time.monotonic() + timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    @property
    def stdout(self) -> str:
        return "".join(r.stdout for r in self.ranks)

    @property
    def stderr(self) -> str:
        return "".join(r.stderr for r in self.ranks)

    def close(self) -> None:
        for r in self.ranks:
            r.close()


def start_main_ranks(target: str, argv: list, nproc: int, env: dict | None = None,
                     log_dir: str | None = None) -> MainRanks:
    """``torchrun --nproc-per-node nproc -m package.module *argv`` on this host without the
    fresh interpreters: ``main(argv)`` of ``target`` in ``nproc`` processes forked as
    :func:`start_main` forks one, each with the environment torchrun gives a rank (one process
    group led by rank 0, so ``kill`` reaches them all)."""
    from parallel_models.distributed import free_port

    env = {k: v for k, v in (os.environ if env is None else env).items()
           if k not in TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0")
    ranks: list = []
    for rank in range(nproc):
        ranks.append(start_main(target, argv, dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                log_dir, process_group=ranks[0].pid if ranks else 0))
    return MainRanks(ranks)
