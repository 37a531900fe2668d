"""Start and stop a rollout server as a subprocess (tests, benchmarks, scripts)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from parallel_models.utils.process_tree import stop_process_tree


def start_server(model: str, port: int, *, tp: int = 1, api_key: str | None = None,
                 extra: tuple[str, ...] = (), log_path: str | None = None,
                 timeout: float = 120.0, enable_admin: bool = True,
                 env: dict | None = None, die_with_parent: bool = False) -> subprocess.Popen:
    """Start ``parallel-models-serve`` (torchrun for tp > 1) on 127.0.0.1 in its own process
    group and wait until ``/health`` answers; ``extra`` are more command-line options.
    ``enable_admin``: without ``api_key``, pass ``--enable-admin`` (the caller drives the
    server it started: it pushes weights and shuts it down). ``env``: more environment
    variables (e.g. ``CUDA_VISIBLE_DEVICES``). ``die_with_parent`` (Linux): the server gets
    SIGTERM when the process that started it dies, even by SIGKILL (no orphan server)."""
    args = ["--model", model, "--port", str(port), "--tp", str(tp), *extra]
    if api_key:
        args += ["--api-key", api_key]
    elif enable_admin:
        args.append("--enable-admin")
    if tp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={tp}", "-m", "parallel_models.inference.server", *args]
    else:
        cmd = [sys.executable, "-m", "parallel_models.inference.server", *args]
    # the server makes its own rendezvous: drop any torchrun variables of the caller
    inherited = {k: v for k, v in os.environ.items()
                 if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                              "MASTER_PORT", "GROUP_RANK") and not k.startswith("TORCHELASTIC_")}
    env = dict(inherited, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", **(env or {}))
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True,
                            preexec_fn=_terminate_with_parent if die_with_parent else None)
    return wait_until_healthy(proc, port, timeout, log_path)


def _terminate_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the caller's atexit stop is all there is
        pass


def wait_until_healthy(proc, port: int, timeout: float, log_path: str | None = None,
                       poll_s: float = 0.3):
    """``proc`` once the server on ``port`` answers ``/health``; a RuntimeError with the end of
    its log if it exits first, a TimeoutError (the server stopped) after ``timeout`` s."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = open(log_path).read()[-3000:] if log_path else ""
            raise RuntimeError(f"server exited with {proc.returncode} during start\n{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    stop_server(proc)
    raise TimeoutError("server did not answer /health in time")


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM the server (its process group, torchrun and its ranks, which run in sessions of
    their own) and wait; SIGKILL whatever is left after ``timeout`` seconds."""
    return stop_process_tree(proc, grace=timeout)
