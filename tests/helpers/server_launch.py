"""Starting ``parallel-models-serve`` in tests with the arguments and environment of
``parallel_models.inference.server.launch.start_server``, without paying a fresh interpreter's
seconds of CPU for importing torch / megatron-core / transformers: the server's ``main`` runs in
processes forked from the preloaded forkserver (``parallel_models.console_processes.start_main``). At TP=1
one process in a session of its own; at TP > 1 one per rank with the environment torchrun gives
them (one process group led by rank 0, so that ``launch.stop_server``'s SIGTERM to the group
reaches every rank, as it reaches torchrun's). ``torchrun=True`` uses the library's launcher
itself (tests/inference/test_server.py keeps that path tested)."""

from __future__ import annotations

import os

from parallel_models.inference.server import launch
from parallel_models.console_processes import TORCHRUN_VARS, MainRanks

stop_server = launch.stop_server


def start_server(model: str, port: int, *, tp: int = 1, api_key: str | None = None,
                 extra: tuple[str, ...] = (), log_path: str | None = None,
                 timeout: float = 120.0, enable_admin: bool = True, torchrun: bool = False):
    """``launch.start_server``'s contract (waits for ``/health``; raises with the log's end when
    the server exits during start, ``TimeoutError`` when it does not answer in time); returns a
    Popen-like handle for ``stop_server``. At TP > 1 the ranks after the first log into
    ``log_path + ".rank<r>"``."""
    if torchrun:
        return launch.start_server(model, port, tp=tp, api_key=api_key, extra=extra,
                                   log_path=log_path, timeout=timeout, enable_admin=enable_admin)
    from parallel_models.distributed import free_port
    from parallel_models.console_processes import start_main

    args = ["--model", model, "--port", str(port), "--tp", str(tp), *extra]
    if api_key:
        args += ["--api-key", api_key]
    elif enable_admin:
        args.append("--enable-admin")
    inherited = {k: v for k, v in os.environ.items()
                 if k not in TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    env = dict(inherited, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore")
    target = "parallel_models.inference.server.cli:main"
    if tp == 1:
        proc = start_main(target, args, env, log_path=log_path or os.devnull, new_session=True)
    else:
        rendezvous = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                          WORLD_SIZE=str(tp), LOCAL_WORLD_SIZE=str(tp), GROUP_RANK="0")
        ranks = []
        for rank in range(tp):
            log = (f"{log_path}.rank{rank}" if rank else log_path) if log_path else os.devnull
            ranks.append(start_main(target, args, dict(env, RANK=str(rank), LOCAL_RANK=str(rank),
                                                       **rendezvous),
                                    log_path=log, process_group=ranks[0].pid if ranks else 0))
        proc = MainRanks(ranks)
    try:
        return launch.wait_until_healthy(proc, port, timeout, log_path, poll_s=0.1)
    except BaseException:  # a forked server left running would keep pytest from exiting
        stop_server(proc)
        raise

