"""Process targets for the background lane (tests/helpers/background_lane.py): the forked
processes of ``parallel_models.console_processes`` (a console script's ``main``) and
``parallel_models.testing`` (a gloo rank) at a low CPU priority. A process forked from the forkserver has the forkserver's priority, not its caller's,
so a test in the lane sends these in their place. Kept free of pytest imports: each forked
process imports this module."""

from __future__ import annotations

import os

NICE = 10  # as tests/helpers/early_runs.py: ~10 % of a shared core, all of an idle one


def niced_main_process(*args) -> None:
    """``parallel_models.console_processes._main_process(*args)`` at niceness ``NICE``."""
    from parallel_models import console_processes

    os.nice(NICE)
    console_processes._main_process(*args)


def niced_worker(*args) -> None:
    """``parallel_models.testing._worker(*args)`` (one rank) at niceness ``NICE``."""
    from parallel_models import testing

    os.nice(NICE)
    testing._worker(*args)
