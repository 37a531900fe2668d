"""A pytest plugin (tests/conftest.py loads it) for long single-process PPO runs: a test marked
``@pytest.mark.early_run(args)`` gets its ``parallel-models-ppo *args`` run started when the
session's collection ends, in a process forked from the preloaded forkserver at a low CPU
priority, so that it uses the cores the tests before it leave idle (most tests run one process;
a 100-step learning run alone is over a minute on one core). The test takes the ``early_run``
fixture: the run's output folder, once the run has ended (its priority raised back where the
system allows it); a failed run fails the test with the end of its stderr. A test collected
alone starts its run at the same point, so it runs exactly as it would have inside the test.
The plugin also starts that forkserver when pytest is configured: its preload (seconds of
imports) runs on another core while pytest collects, instead of after collection."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

NICE = 10  # against tests at 0: ~10 % of a shared core, all of an idle one
MARK = "early_run"
_RUNS: dict[str, tuple] = {}  # test node id -> (handle, output folder)


def niced_main(argv: list) -> int | None:
    """``main(argv[2:])`` of ``argv[1]`` ("package.module:main") at niceness ``argv[0]``."""
    import importlib

    os.nice(int(argv[0]))
    module, name = argv[1].split(":")
    return getattr(importlib.import_module(module), name)(list(argv[2:]))


def pytest_configure(config):
    config.addinivalue_line("markers", f"{MARK}(args): the test's parallel-models-ppo run "
                                       "starts when collection ends (tests/helpers/early_runs.py)")
    if not config.option.collectonly:  # its preload imports run on another core meanwhile
        from parallel_models.testing import start_forkserver

        start_forkserver()


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    from parallel_models.console_processes import start_main
    from tests.helpers.ppo_runs import ENV, MAIN

    for item in session.items:
        mark = item.get_closest_marker(MARK)
        if mark is None or item.nodeid in _RUNS:
            continue
        out = tempfile.mkdtemp(prefix="early_run_")
        args = [*mark.args[0], f"trainer.output_dir={os.path.join(out, 'run')}"]
        _RUNS[item.nodeid] = (start_main("tests.helpers.early_runs:niced_main",
                                         [str(NICE), MAIN, *args], ENV), out)


def pytest_sessionfinish(session):
    for handle, out in _RUNS.values():
        if handle.poll() is None:  # the session stopped before its test (-x, Ctrl-C)
            handle.kill()
            handle.wait()
        handle.close()
        shutil.rmtree(out, ignore_errors=True)
    _RUNS.clear()


@pytest.fixture
def early_run(request):
    """The output folder of this test's ``early_run`` PPO run, once it has ended."""
    if request.node.nodeid not in _RUNS:
        pytest.fail(f"{request.node.nodeid}: the early_run fixture needs @pytest.mark.{MARK}",
                    pytrace=False)
    handle, out = _RUNS[request.node.nodeid]
    try:
        os.setpriority(os.PRIO_PROCESS, handle.pid, 0)  # the session waits on it now
    except (PermissionError, ProcessLookupError):
        pass  # an unprivileged user cannot lower a niceness: it finishes at NICE
    try:
        handle.wait(600)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the early run did not end in 600 s\n{handle.stderr[-3000:]}")
    assert handle.returncode == 0, f"exit {handle.returncode}\n{handle.stderr[-3000:]}"
    return os.path.join(out, "run")
