"""Asynchronous RL (``trainer.mode=async``, ``parallel_models/rl/async_rollout/``): the trainer
starts its own rollout server and a producer fills a bounded queue while it trains.

With ``rollout.max_staleness=0`` and greedy rollouts the run is the sync run (its metrics equal
the in-process sync run's within rel 1e-5, the server's greedy tokens being the engine's); at
``max_staleness=1`` the samples are at most one version behind and the rollout overlaps the
update (``rollout.partial``: a push lands while a request is in flight, tests/rl/
test_async_partial.py checks the tokens of both versions)."""

import json
import time

import pytest

from parallel_models.distributed import free_port
from parallel_models.testing import run_distributed_jobs
from parallel_models.utils.fault_points import ENV as FAULT_ENV
from tests.helpers import async_runs, server_checks
from tests.helpers.hybrid_ppo_runs import SHORT_RUN
from tests.helpers.ppo_runs import ENV, run_metrics, start_ppo
from tests.helpers.server_launch import start_server, stop_server

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py

REL, ABS_FLOOR = 1e-5, 1e-6
CORRECTION = ["actor.rollout_correction.level=token"]  # async's default, set for the sync run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    path = server_checks.tiny_builtin_model(str(root / "model"), seed=1)
    common = [f"model.path={path}", "data.max_prompt_length=16", *validation(root)]
    port = free_port()  # one server for both async runs (each pushes its weights first)
    fleet = ["trainer.mode=async", f"rollout.server_url=http://127.0.0.1:{port}"]
    k0 = str(root / "async_k0")
    jobs = {  # name: (output folder, overrides, keywords)
        "sync": (str(root / "sync"), [*common, *CORRECTION], {}),
        "async_k0": (k0, [*common, *fleet, "rollout.max_staleness=0"], {"save_after": 1}),
        # the k=0 run again from its step-1 checkpoint: the queue rebuilt from the trainer's cursor
        "resumed_k0": (k0, [*common, *fleet, "rollout.max_staleness=0"], {"resume": True}),
        "async_k1": (str(root / "k1"), [*common, *fleet, "rollout.max_staleness=1",
                                        "rollout.partial=true"], {}),
        "held_k2": (str(root / "k2"), [*common, *fleet, "rollout.max_staleness=2"],
                    {"hook": async_runs.hold_pushes_until_queued}),
    }
    proc = start_server(path, port, log_path=str(root / "server.log"),
                        extra=("--partial-rollouts",))  # (no request is in flight at k = 0)
    try:
        results = run_distributed_jobs(
            [(async_runs.ppo_run, (out, over), kw) for out, over, kw in jobs.values()], 1,
            timeout=600)
        # data parallel: each replica's first rank runs a producer for its share of the prompts
        dp2 = run_distributed_jobs([(async_runs.ppo_run, (str(root / "dp2"), [
            *common, *fleet, "rollout.max_staleness=0"]))], 2, timeout=600)[0]
    finally:
        stop_server(proc)
    return {**{name: r[0] for name, r in zip(jobs, results)}, "async_k0_dp2": dp2[0],
            "common": common}


def validation(root) -> list[str]:
    """Validation at steps 2 and 3 (``trainer.test_freq``) on 3 prompts of a file of its own."""
    val = root / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": p}) + "\n"
                           for p in ("name a color:", "say hello:", "count to three:")))
    return [f"data.val_path={val}", "trainer.test_freq=2"]


ROUNDING_KEYS = ("rollout_corr/", "rollout/logprob_diff", "rollout/k3_kl")
"""The rollout-vs-training mismatch statistics: zero up to rounding where both sides run the
same weights (chi2 and log-prob differences ~1e-7 .. 1e-6, which move with the batch shapes the
server's engine and the in-process one sum in): compared with an absolute floor of 1e-5, as at
DP=2 (a package update moved them by 1.5e-6 in session 24)."""


def _same(got: dict, want: dict, step: int, floor: float = ABS_FLOOR) -> None:
    for k in want:
        base = max(floor, 1e-5) if k.startswith(ROUNDING_KEYS) else floor
        tol = REL * max(abs(want[k]), abs(got[k])) + base
        assert abs(got[k] - want[k]) <= tol, f"step {step + 1} {k}: {got[k]} vs {want[k]}"


def test_max_staleness_0_greedy_is_the_sync_run(runs):
    """(validation at steps 2 and 3 too: in async mode it generates now, on the server, under the
    weights just pushed, as the sync run's engine does)"""
    sync, k0 = runs["sync"]["metrics"], runs["async_k0"]["metrics"]
    assert len(sync) == len(k0) == 3
    assert [any(k.startswith("val/") for k in m) for m in k0] == [False, True, True]
    for step, (got, want) in enumerate(zip(k0, sync)):
        extra = {k for k in got if k.startswith("async/")}
        assert got.keys() - extra == want.keys(), sorted((got.keys() - extra) ^ want.keys())
        _same({k: got[k] for k in want}, want, step)
        assert got["async/staleness_max"] == 0 and got["async/dropped_samples"] == 0


def test_async_at_dp2_is_the_sync_run(runs):
    """(the mismatch statistics that are zero up to rounding, chi2 ~ 1e-7, are summed over two
    ranks here: an absolute floor of 1e-5)"""
    for step, (got, want) in enumerate(zip(runs["async_k0_dp2"]["metrics"],
                                           runs["sync"]["metrics"])):
        _same({k: got[k] for k in want}, want, step, floor=1e-5)


def test_max_staleness_1_trains_no_older_sample(runs):
    for m in runs["async_k1"]["metrics"]:
        assert m["async/staleness_max"] <= 1
        assert 0 <= m["async/staleness_mean"] <= m["async/staleness_max"]
        assert m["async/dropped_samples"] == 0 and m["async/partial_samples"] >= 0
        assert "rollout_corr/weight_mean" in m  # the decoupled PPO correction, on by default


def test_a_slowed_trainer_trains_samples_exactly_k_old_never_older(runs):
    """The trainer holds each push until the producer has run k = 2 steps ahead."""
    staleness = [m["async/staleness_max"] for m in runs["held_k2"]["metrics"]]
    assert staleness == [0, 1, 2]
    assert [m["async/staleness_mean"] for m in runs["held_k2"]["metrics"]] == [0, 1, 2]
    assert all(m["async/dropped_samples"] == 0 for m in runs["held_k2"]["metrics"])


def test_resumed_async_run_continues_the_uninterrupted_one(runs):
    """A k = 0 run resumed from its step-1 checkpoint trains steps 2 and 3 on the prompts and
    samples of the uninterrupted run (the data cursor is the trainer's: none twice, none
    skipped): the same metrics."""
    resumed, whole = runs["resumed_k0"], runs["async_k0"]
    assert whole["checkpoint"] and resumed["step"] == 3 and len(resumed["metrics"]) == 2
    for step, (got, want) in enumerate(zip(resumed["metrics"], whole["metrics"][1:]), 1):
        assert got.keys() == want.keys()
        _same(got, {k: v for k, v in want.items() if not k.endswith("_idle_s")}, step)


def _server_of(trainer_pid: int):
    """The rollout server process the trainer ``trainer_pid`` started (its child running
    ``parallel_models.inference.server``), or None."""
    import psutil

    try:
        for child in psutil.Process(trainer_pid).children():
            if "parallel_models.inference.server" in child.cmdline():
                return child
    except psutil.Error:  # the trainer (or the child) is gone
        pass
    return None


def _gone(process, timeout: float = 60.0) -> bool:
    """Has ``process`` exited (a zombie no reaper collected counts as exited) within ``timeout``?"""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_killed_async_run_resumes_as_the_uninterrupted_one(runs, tmp_path):
    """``parallel-models-ppo`` at k = 0 starting its own rollout server, SIGKILLed in step 2
    once the step's samples are taken from the queue (fault point ``step:after_rollout@2``, the
    step-1 checkpoint written), then ``--resume=auto``: the server it started died with it (no
    orphan), the resumed run's server is stopped at its end, every step is logged once and the
    metrics equal the uninterrupted k = 0 run's (the samples lost in the kill regenerated from
    the trainer's data cursor: none trained twice, none skipped)."""
    out = str(tmp_path / "killed")
    args = [f"trainer.output_dir={out}", *SHORT_RUN, *runs["common"], "trainer.save_every=1",
            "trainer.loggers=[jsonl]", "trainer.save_hf_at_end=false", "trainer.mode=async",
            "rollout.max_staleness=0", "--resume=auto"]
    for resumed in (False, True):
        spec = "step:after_rollout@2"
        proc = start_ppo(args, env=ENV if resumed else {**ENV, FAULT_ENV: spec})
        try:
            server = None
            while server is None and proc.poll() is None:  # the server lives for >= one step
                server = _server_of(proc.pid)
                time.sleep(0.05)
            code = proc.wait(300)
            assert server is not None, f"no rollout server seen\n{proc.stderr[-3000:]}"
            if resumed:
                assert code == 0, f"resumed run: exit {code}\n{proc.stderr[-3000:]}"
            else:
                assert code == -9 and f"fault point {spec}: SIGKILL" in proc.stderr, \
                    f"exit {code}, not killed at {spec}\n{proc.stderr[-3000:]}"
            assert _gone(server), f"the rollout server {server.pid} outlived its trainer"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.close()
    got, want = run_metrics(out), runs["async_k0"]["metrics"]
    assert [m["step"] for m in got] == [0, 1, 2, 3]  # (step 0: validation before training)
    assert any(k.startswith("val/") for k in got[0])
    for step, (g, w) in enumerate(zip(got[1:], want)):
        w = {k: v for k, v in w.items() if not k.endswith("_idle_s")}
        assert w.keys() <= g.keys(), sorted(w.keys() - g.keys())
        _same({k: g[k] for k in w}, w, step)
