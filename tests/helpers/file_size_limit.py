"""``parallel-models-ppo`` with a file size limit (``RLIMIT_FSIZE``), for tests of a save that
runs out of space: every write past the limit fails with EFBIG, as writes on a full disk fail with
ENOSPC. Run it through :func:`parallel_models.console_processes.start_main` as
``"tests.helpers.file_size_limit:main"`` with ``[limit_bytes, *ppo_args]``."""

from __future__ import annotations

import resource
import signal


def main(argv: list[str]) -> int:
    limit = int(argv[0])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(
        resource.RLIMIT_FSIZE)[1]))
    from parallel_models.rl.train import main as ppo_main

    return ppo_main(argv[1:])
