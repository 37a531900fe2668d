"""A console-script ``main`` for tests of ``parallel_models.console_processes``: waits until a
file exists, then exits with the given code (``main([flag_path, code])``)."""

from __future__ import annotations

import os
import time


def main(argv: list) -> int:
    flag, code = argv[0], int(argv[1])
    deadline = time.monotonic() + 120
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.01)
    return code
