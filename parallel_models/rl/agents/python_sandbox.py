"""The built-in ``python`` tool: the model's code run in a fresh, limited interpreter process.

Each call starts ``<this python> -I -S`` (isolated mode: no ``PYTHON*`` variables, no user
site-packages, no current folder on ``sys.path``; no ``site`` import) in a new session, with:

* an **empty environment** (``env={}``) and stdin from ``/dev/null``;
* a **temporary working folder**, its own, removed afterwards (with what the code wrote there);
* **CPU time** ``RLIMIT_CPU`` (SIGXCPU at the limit, SIGKILL a second later);
* **memory** ``RLIMIT_AS`` (the address space: an allocation past it is a ``MemoryError``);
* **output size** ``RLIMIT_FSIZE``: stdout and stderr go to files in the working folder, and a
  write past ``max_output_bytes`` (also into any file the code writes) fails (Python ignores
  SIGXFSZ, so the write raises ``OSError: File too large`` and the code usually dies of it);
  an output file at the limit is reported as a breach of it;
* **wall-clock** time: past ``wall_seconds`` the whole process group is killed (also when the
  code sleeps or blocks, which uses no CPU); the group is killed after every call anyway, so
  processes the code started do not outlive it.

The limits are set by a small launcher inside the child before the code runs (hard limits too,
so the code cannot raise them), not through ``preexec_fn`` (unsafe in a threaded process).

**What it does not isolate:** the network (the code can open sockets), reads of the file system
(whatever the user running the trainer may read, the code may read, and it may write outside
its folder where that user may write, within the file-size limit), the number of processes it
starts (only their lifetime), and the machine's other resources (it runs as the same user, with
no namespaces, seccomp or containers). Run untrusted policies' code in a container or a VM of
its own when that matters.

A breach of a limit, a non-zero exit (an exception in the code) or a crash raises
:class:`ToolError` with what happened and the output so far: the executor hands that message
to the model as the tool result and counts it as a tool error.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from parallel_models.rl.agents.schema import Tool


class ToolError(RuntimeError):
    """A tool call that failed; the message is what the model reads."""


# runs first in the child: limits (soft = hard), then the code as __main__
_LAUNCHER = """
import resource, sys
cpu, memory, output = (int(x) for x in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (output, output))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
sys.argv = ["snippet.py"]
source = open("snippet.py").read()
del cpu, memory, output, resource
exec(compile(source, "snippet.py", "exec"), {"__name__": "__main__"})
"""


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one call: CPU seconds, address space in MiB, bytes of stdout + stderr
    (each), wall-clock seconds, and the characters of output handed back to the model."""

    cpu_seconds: int = 5
    memory_mb: int = 512
    max_output_bytes: int = 1 << 20
    wall_seconds: float = 10.0
    max_result_chars: int = 4000

    def __post_init__(self):
        for name in ("cpu_seconds", "memory_mb", "max_output_bytes", "wall_seconds",
                     "max_result_chars"):
            if not getattr(self, name) > 0:
                raise ValueError(f"python sandbox: {name} must be > 0, got "
                                 f"{getattr(self, name)!r}")


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> str:
    """Run ``code`` in the sandbox; its stdout (and stderr, if any) as text, or
    :class:`ToolError` (see the module docstring)."""
    if not isinstance(code, str):
        raise ToolError(f"'code' must be a string, got {type(code).__name__}")
    folder = tempfile.mkdtemp(prefix="pm_python_tool_")
    try:
        with open(os.path.join(folder, "snippet.py"), "w") as f:
            f.write(code)
        out_path, err_path = os.path.join(folder, ".stdout"), os.path.join(folder, ".stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            args = [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(int(limits.cpu_seconds)),
                    str(int(limits.memory_mb) << 20), str(int(limits.max_output_bytes))]
            start = time.monotonic()
            proc = subprocess.Popen(args, cwd=folder, env={}, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
            elapsed = time.monotonic() - start
        at_limit = max(os.path.getsize(out_path), os.path.getsize(err_path)) \
            >= limits.max_output_bytes
        stdout, stderr = _read(out_path, limits), _read(err_path, limits)
        return _result(proc.returncode, timed_out, at_limit, elapsed, stdout, stderr, limits)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read(path: str, limits: SandboxLimits) -> str:
    with open(path, "rb") as f:
        data = f.read(limits.max_result_chars * 4 + 4)
    text = data.decode("utf-8", errors="replace")
    if len(text) > limits.max_result_chars or os.path.getsize(path) > len(data):
        text = text[:limits.max_result_chars] + "\n[output truncated]"
    return text


def _result(returncode: int, timed_out: bool, output_at_limit: bool, elapsed: float,
            stdout: str, stderr: str, limits: SandboxLimits) -> str:
    so_far = (f"\noutput so far:\n{stdout}" if stdout else "") + \
             (f"\nstderr:\n{stderr}" if stderr else "")
    if timed_out:
        raise ToolError(f"python: stopped after {limits.wall_seconds:g} s of wall-clock time "
                        f"(the limit){so_far}")
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL) and elapsed < limits.wall_seconds:
        raise ToolError(f"python: stopped at the CPU-time limit of {limits.cpu_seconds} s"
                        f"{so_far}")
    if returncode == -signal.SIGXFSZ or output_at_limit:
        raise ToolError(f"python: stopped at the output limit of {limits.max_output_bytes} "
                        f"bytes{so_far}")
    if returncode != 0 and "MemoryError" in stderr:
        raise ToolError(f"python: out of memory (the limit is {limits.memory_mb} MiB){so_far}")
    if returncode < 0:
        raise ToolError(f"python: killed by signal {signal.Signals(-returncode).name}{so_far}")
    if returncode != 0:
        raise ToolError(f"python: exited with status {returncode}{so_far}")
    return stdout + (f"\nstderr:\n{stderr}" if stderr else "")


def python_tool(limits: SandboxLimits = SandboxLimits()) -> Tool:
    """The ``python`` tool with ``limits``."""
    return Tool(
        name="python",
        description="Run a Python program in a fresh interpreter and return what it prints "
                    f"(limits: {limits.cpu_seconds} s CPU, {limits.memory_mb} MiB memory, "
                    f"{limits.wall_seconds:g} s wall-clock; no third-party packages).",
        parameters={"type": "object",
                    "properties": {"code": {"type": "string",
                                            "description": "the program; print the results"}},
                    "required": ["code"], "additionalProperties": False},
        run=lambda code: run_python(code, limits))


PYTHON = python_tool()

__all__ = ["PYTHON", "SandboxLimits", "ToolError", "python_tool", "run_python"]
