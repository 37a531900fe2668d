"""A pytest plugin (tests/conftest.py loads it): the background lane. Tests marked
``@pytest.mark.background_lane`` (or a module's ``pytestmark``) that spend their time in
processes of their own (torchrun launches, console-script runs, kill -9 and resume, servers)
run, in collection order, in one process forked from pytest when collection ends, at a low CPU
priority, so that they use the core the other tests leave idle (most tests run one process).
When the session reaches such a test it waits for the lane's reports of it and reports them as
its own: the same test, fixtures, asserts and outcome; only the process differs.

The lane is a fork of the collected session: it runs each test through pytest's own
``pytest_runtest_protocol`` (fixtures, capture, warnings, timeouts), the module-scoped fixtures
of the lane's modules once in the lane, and sends every report (and the warnings pytest
recorded) back as pytest-xdist does (``pytest_report_to_serializable``). What the lane's tests
start through ``parallel_models.testing`` / ``console_processes`` (forked from the preloaded
forkserver, which would give them its priority) runs at the lane's priority
(tests/helpers/niced_targets.py); a subprocess inherits it. A module goes into the lane whole
(its module fixtures then run once, in the lane), or a test whose fixtures are its own (``tmp_path``): a module or session fixture
that tests outside the lane use too would run in both processes. A test whose asserts time a
limit does not belong in it (it runs at a low priority); one marked ``timed`` runs in the
session with the niced background (the lane and what it started, torchrun's workers too, and
the early runs) stopped by SIGSTOP until its call ends. Without a test outside the lane to
overlap (a lane module collected alone), under ``--pdb``, or with CUDA initialised, the tests
run in-process."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import tempfile
import time

import pytest

from tests.helpers.niced_targets import NICE

MARK = "background_lane"
WAIT_S = 580.0  # under pytest-timeout's 600 s for the test that waits
_LANE: dict = {}  # pid, folder, index: nodeid -> position, status: the lane's wait status
_IN_LANE = False  # True in the lane's process


TIMED = "timed"


def pytest_configure(config):
    config.addinivalue_line("markers", f"{MARK}: runs in the background lane, a low-priority "
                                       "fork of the session (tests/helpers/background_lane.py)")
    config.addinivalue_line("markers", f"{TIMED}: asserts wall-clock limits; the session's "
                                       "niced background (the lane, early runs) is stopped "
                                       "while it runs (tests/helpers/background_lane.py)")


def _niced_background() -> list[int]:
    """This process's descendants at niceness ``NICE`` or more: the lane and what it started,
    the early runs (torchrun's workers among them, though they lead sessions of their own)."""
    parent, nice = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command's name
        except OSError:
            continue
        parent[int(name)], nice[int(name)] = int(fields[1]), int(fields[16])
    me, pids = os.getpid(), []
    for pid in parent:
        up, seen = parent[pid], 0
        while up not in (me, 0, 1) and up in parent and seen < 64:
            up, seen = parent[up], seen + 1
        if up == me and nice[pid] >= NICE:
            pids.append(pid)
    return pids


def _signal_all(pids: list, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A ``timed`` test runs with the niced background stopped (SIGSTOP, then SIGCONT), as if
    the machine were its own: its limits were measured so."""
    if item.get_closest_marker(TIMED) is None or _IN_LANE or not sys.platform.startswith("linux"):
        return (yield)
    stopped = _niced_background()
    _signal_all(stopped, signal.SIGSTOP)
    try:
        return (yield)
    finally:
        _signal_all(stopped, signal.SIGCONT)


def _lane_items(session) -> list:
    items = [item for item in session.items if item.get_closest_marker(MARK)]
    if not items or len(items) == len(session.items) or session.config.getoption("usepdb"):
        return []
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        return []  # a fork cannot use CUDA
    return items


@pytest.hookimpl(trylast=True)  # after tests/helpers/early_runs.py started its runs
def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    items = _lane_items(session)
    if not items:
        return
    session.config._tmp_path_factory.getbasetemp()  # one base folder for both processes
    folder = tempfile.mkdtemp(prefix="background_lane_")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the lane
        global _IN_LANE
        _IN_LANE = True
        code = 1
        try:
            _run_lane(session, items, folder)
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    _LANE.update(pid=pid, folder=folder, index={item.nodeid: i for i, item in enumerate(items)},
                 status=None)


def _run_lane(session, items: list, folder: str) -> None:
    """In the forked process: every lane test in turn, its reports to ``folder/<i>.pickle``."""
    import multiprocessing.process
    from multiprocessing import forkserver, resource_tracker

    from parallel_models import console_processes, testing
    from tests.helpers import niced_targets

    # the session's processes (early runs) are not the lane's: polling one here would read the
    # exit status that the session waits for
    multiprocessing.process._children.clear()
    os.setpgid(0, 0)  # the session's end stops the lane and its subprocesses at once
    os.nice(NICE)
    config = session.config
    log = os.open(os.path.join(folder, "lane.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None and capman._global_capturing is not None:
        capman._global_capturing.suspend_capturing()  # the parent's capture files stay its own
        capman._global_capturing = None
    os.dup2(log, 1)
    os.dup2(log, 2)
    if capman is not None and capman._method != "no":
        capman.start_global_capturing()
    # the session's forkserver serves this process too; it is not this process's child. Should
    # it be gone (killed: its processes' exit codes then come from console_processes' records),
    # the lane starts one of its own
    server, start_own = forkserver._forkserver, forkserver._forkserver.ensure_running

    def ensure_running():
        if server._forkserver_pid is not None and \
                not console_processes.process_running(server._forkserver_pid):
            server._forkserver_address = server._forkserver_alive_fd = None
            server._forkserver_pid = None
        if server._forkserver_pid is None:
            return start_own()
        resource_tracker.ensure_running()

    server.ensure_running = ensure_running
    console_processes._main_process = niced_targets.niced_main_process
    testing._worker = niced_targets.niced_worker
    reports: list = []
    caught: list = []  # the warnings pytest recorded during the test, as plain values

    class Recorder:
        def pytest_runtest_logreport(self, report):
            reports.append(report)

        def pytest_warning_recorded(self, warning_message, when, nodeid):
            if recording:  # (registering replays the session's earlier warnings)
                caught.append((str(warning_message.message), _picklable(warning_message.category),
                               warning_message.filename, warning_message.lineno,
                               warning_message.line, when, nodeid))

    recording = False
    config.pluginmanager.register(Recorder(), "background_lane_recorder")
    recording = True
    for i, item in enumerate(items):
        reports.clear()
        caught.clear()
        nextitem = items[i + 1] if i + 1 < len(items) else None
        item.ihook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        data = {"reports": [config.hook.pytest_report_to_serializable(config=config, report=r)
                            for r in reports], "warnings": list(caught)}
        path = os.path.join(folder, f"{i}.pickle")
        with open(path + ".tmp", "wb") as f:
            pickle.dump(data, f)
        os.rename(path + ".tmp", path)


def _picklable(category: type) -> type:
    """A warning's category, or ``UserWarning`` where it cannot be sent by reference."""
    try:
        pickle.dumps(category)
    except Exception:
        return UserWarning
    return category


def _lane_failure(item, message: str) -> list:
    """Reports of ``item`` failed in its call with ``message`` (the lane ended or hung)."""
    from _pytest.reports import TestReport
    from _pytest.runner import CallInfo

    def fail():
        pytest.fail(message, pytrace=False)

    return [TestReport.from_item_and_call(item, CallInfo.from_call(fn, when))
            for fn, when in ((lambda: None, "setup"), (fail, "call"), (lambda: None, "teardown"))]


def _lane_reports(item) -> list:
    """The lane's reports of ``item``, once it has sent them."""
    path = os.path.join(_LANE["folder"], f"{_LANE['index'][item.nodeid]}.pickle")
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(path):
        if _LANE["status"] is None:
            pid, status = os.waitpid(_LANE["pid"], os.WNOHANG)
            if pid:
                _LANE["status"] = status
        if _LANE["status"] is not None and not os.path.exists(path):
            code = os.waitstatus_to_exitcode(_LANE["status"])
            return _lane_failure(item, f"the background lane ended (exit code {code}) before "
                                       f"it ran {item.nodeid}:\n" + _log_tail())
        if time.monotonic() > deadline:
            return _lane_failure(item, f"the background lane did not finish {item.nodeid} "
                                       f"in {WAIT_S:.0f} s:\n" + _log_tail())
        time.sleep(0.02)
    with open(path, "rb") as f:
        data = pickle.load(f)
    import warnings

    for message, category, filename, lineno, line, when, nodeid in data["warnings"]:
        item.ihook.pytest_warning_recorded.call_historic(kwargs=dict(
            warning_message=warnings.WarningMessage(message, category, filename, lineno,
                                                    line=line),
            when=when, nodeid=nodeid, location=None))
    config = item.config
    return [config.hook.pytest_report_from_serializable(config=config, data=d)
            for d in data["reports"]]


def _log_tail() -> str:
    try:
        with open(os.path.join(_LANE["folder"], "lane.log"), errors="replace") as f:
            return f.read()[-3000:]
    except OSError:
        return ""


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if not _LANE or item.nodeid not in _LANE["index"]:
        return None
    from _pytest.reports import TestReport
    from _pytest.runner import CallInfo

    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = _lane_reports(item)
    # what this process set up for the tests before it and the next one does not need
    teardown = CallInfo.from_call(lambda: item.session._setupstate.teardown_exact(nextitem),
                                  "teardown")
    if teardown.excinfo is not None:
        reports.append(TestReport.from_item_and_call(item, teardown))
    for report in reports:
        ihook.pytest_runtest_logreport(report=report)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_sessionfinish(session):
    if not _LANE:
        return
    if _LANE["status"] is None:
        try:
            os.killpg(_LANE["pid"], signal.SIGKILL)  # a no-op once it ended
        except ProcessLookupError:
            pass
        os.waitpid(_LANE["pid"], 0)
    import shutil

    shutil.rmtree(_LANE["folder"], ignore_errors=True)
    _LANE.clear()
