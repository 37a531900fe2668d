"""Asynchronous RL (``trainer.mode=async``, ``parallel_models/rl/async_rollout/``): the trainer
starts its own rollout server and a producer fills a bounded queue while it trains.

With ``rollout.max_staleness=0`` and greedy rollouts the run is the sync run (its metrics equal
the in-process sync run's within rel 1e-5, the server's greedy tokens being the engine's); at
``max_staleness=1`` the samples are at most one version behind and the rollout overlaps the
update (``rollout.partial``: a push lands while a request is in flight, tests/rl/
test_async_partial.py checks the tokens of both versions)."""

import pytest

from parallel_models.distributed import free_port
from parallel_models.testing import run_distributed_jobs
from tests.helpers import async_runs, server_checks
from tests.helpers.server_launch import start_server, stop_server

REL, ABS_FLOOR = 1e-5, 1e-6
CORRECTION = ["actor.rollout_correction.level=token"]  # async's default, set for the sync run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    path = server_checks.tiny_builtin_model(str(root / "model"), seed=1)
    common = [f"model.path={path}", "data.max_prompt_length=16"]
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
    return {**{name: r[0] for name, r in zip(jobs, results)}, "async_k0_dp2": dp2[0]}


def _same(got: dict, want: dict, step: int, floor: float = ABS_FLOOR) -> None:
    for k in want:
        tol = REL * max(abs(want[k]), abs(got[k])) + floor
        assert abs(got[k] - want[k]) <= tol, f"step {step + 1} {k}: {got[k]} vs {want[k]}"


def test_max_staleness_0_greedy_is_the_sync_run(runs):
    sync, k0 = runs["sync"]["metrics"], runs["async_k0"]["metrics"]
    assert len(sync) == len(k0) == 3
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
