"""A script's own ``torchrun`` launches, run in tests as forked ranks: ``ForkingSubprocess`` stands
in for the ``subprocess`` module of a script loaded in the test's process (e.g. a bench) and
starts ``python -m torch.distributed.run --nproc-per-node N ... -m package.module args`` as N
processes forked from the preloaded forkserver (``parallel_models.console_processes.start_main_ranks``,
torchrun's environment per rank) instead of a launcher and N fresh interpreters (seconds of CPU
each for importing torch / megatron-core / transformers). Every other command goes to the real
``subprocess``. The torchrun launcher itself is tested where it is the subject
(tests/distributed/test_multinode.py, tests/test_quiet_runs.py, tests/test_examples.py)."""

from __future__ import annotations

import subprocess
import sys

# torchrun options this stand-in understands, with whether they take a value
_OPTIONS = {"--nproc-per-node": True, "--nproc_per_node": True, "--master-port": True,
            "--master_port": True, "--standalone": False}


def parse_torchrun(cmd: list) -> tuple[int, str, list] | None:
    """``(nproc, "package.module:main", args)`` of a ``python -m torch.distributed.run`` (or
    ``torchrun``) command line of a single node running a module; None for any other command."""
    cmd = [str(c) for c in cmd]
    if cmd[1:3] == ["-m", "torch.distributed.run"]:
        rest = cmd[3:]
    elif cmd and cmd[0].endswith("torchrun"):
        rest = cmd[1:]
    else:
        return None
    nproc, i = 1, 0
    while i < len(rest) and rest[i] != "-m":
        name, _, inline = rest[i].partition("=")
        if name not in _OPTIONS:
            return None  # an option (e.g. several nodes) this stand-in does not reproduce
        value = inline or (rest[i + 1] if _OPTIONS[name] and not inline else None)
        if name.startswith("--nproc"):
            nproc = int(value)
        i += 1 if inline or not _OPTIONS[name] else 2
    if i + 1 >= len(rest):
        return None
    return nproc, f"{rest[i + 1]}:main", rest[i + 2:]


class _EchoedRanks:
    """The forked ranks' handle; once they end, their output goes to this process's stdout and
    stderr, as a torchrun child's would have."""

    def __init__(self, ranks):
        self._ranks, self.pid, self.args = ranks, ranks.pid, ranks.args
        self._echoed = False

    def poll(self):
        code = self._ranks.poll()
        if code is not None and not self._echoed:
            self._echoed = True
            sys.stdout.write(self._ranks.stdout)
            sys.stderr.write(self._ranks.stderr)
            self._ranks.close()
        return code

    @property
    def returncode(self):
        return self.poll()

    def wait(self, timeout: float | None = None) -> int:
        self._ranks.wait(timeout)
        return self.poll()

    def kill(self) -> None:
        self._ranks.kill()


class ForkingSubprocess:
    """The ``subprocess`` module with ``Popen`` of a single-node torchrun command replaced by
    forked ranks (Popen-like: ``pid`` leads their process group, ``wait`` / ``poll`` /
    ``returncode`` / ``kill``)."""

    def __getattr__(self, name):
        return getattr(subprocess, name)

    @staticmethod
    def Popen(cmd, *args, env=None, **kwargs):  # noqa: N802 (subprocess's name)
        from parallel_models.console_processes import start_main_ranks

        launch = parse_torchrun(cmd)
        if launch is None or args or set(kwargs) - {"start_new_session"}:
            return subprocess.Popen(cmd, *args, env=env, **kwargs)
        nproc, target, argv = launch
        return _EchoedRanks(start_main_ranks(target, argv, nproc, env))
