"""Running a Python script (``python path/to/script.py args``) in tests without a fresh
interpreter: ``run_script`` is a ``main`` for ``parallel_models.console_processes.start_main``, so the
script runs in a process forked from the preloaded forkserver (torch / megatron-core /
transformers imported once, not seconds of CPU per run) exactly as ``python`` runs it: as
``__main__``, with ``sys.argv`` set and the script's folder first on ``sys.path``."""

from __future__ import annotations

import os
import runpy
import sys

TARGET = "tests.helpers.forked_script:run_script"


def run_script(argv: list) -> int:
    """``python argv[0] *argv[1:]``; its ``SystemExit`` code (0 when it returns)."""
    path = os.path.abspath(argv[0])
    sys.argv = [path, *argv[1:]]
    sys.path.insert(0, os.path.dirname(path))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as err:
        return err.code
    return 0
