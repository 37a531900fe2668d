"""Starting ``parallel-models-serve`` in tests with the arguments and environment of
``parallel_models.inference.server.launch.start_server``: at TP=1 the server's ``main`` runs in a
process forked from the preloaded forkserver (``parallel_models.testing.start_main``, in a
session of its own so that ``launch.stop_server`` stops it the same way), which saves the
seconds of CPU a fresh interpreter spends importing torch / megatron-core / transformers; at
TP > 1 the library's launcher itself (torchrun) starts it, so that path stays tested."""

from __future__ import annotations

import os
import time

from parallel_models.inference.server import launch

stop_server = launch.stop_server
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "GROUP_RANK")


def start_server(model: str, port: int, *, tp: int = 1, api_key: str | None = None,
                 extra: tuple[str, ...] = (), log_path: str | None = None,
                 timeout: float = 120.0, enable_admin: bool = True):
    """``launch.start_server``'s contract (waits for ``/health``; raises with the log's end when
    the server exits during start, ``TimeoutError`` when it does not answer in time); returns a
    Popen-like handle for ``stop_server``."""
    if tp > 1:
        return launch.start_server(model, port, tp=tp, api_key=api_key, extra=extra,
                                   log_path=log_path, timeout=timeout, enable_admin=enable_admin)
    import httpx

    from parallel_models.testing import start_main

    args = ["--model", model, "--port", str(port), "--tp", str(tp), *extra]
    if api_key:
        args += ["--api-key", api_key]
    elif enable_admin:
        args.append("--enable-admin")
    inherited = {k: v for k, v in os.environ.items()
                 if k not in _TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    env = dict(inherited, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore")
    proc = start_main("parallel_models.inference.server.cli:main", args, env,
                      log_path=log_path or os.devnull, new_session=True)
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
        time.sleep(0.1)
    stop_server(proc)
    raise TimeoutError("server did not answer /health in time")
