"""The comparison the hybrid-engine PPO tests make: 3 seeded greedy PPO steps at a training /
rollout layout against the same run at PP=1, TP=1 on one rank (greedy rollouts: which rank
generates a prompt cannot change the samples)."""

from __future__ import annotations

from parallel_models.testing import run_distributed, run_distributed_jobs
from tests.helpers import hybrid_checks

SHORT_RUN = ["trainer.total_steps=3", "data.batch_size=4", "rollout.n=2",
             "actor.mini_batch_size=8", "rollout.max_new_tokens=6", "actor.ppo_epochs=1",
             "rollout.greedy=true", "trainer.seed=3"]
REL = 1e-5
ABS_FLOOR = 1e-6  # metrics that are zero up to rounding (the whitened pg_loss, advantages/mean)


def metrics_at(tmp_path, world: int, layout: list[str], name: str,
               continuous: bool = False) -> list[dict]:
    """The run's metrics (timings aside); ``continuous``: the rollout engine must have batched
    continuously (else statically)."""
    rows = run_distributed(hybrid_checks.ppo_metrics, world, str(tmp_path / name),
                           SHORT_RUN + layout, report_engine=True, timeout=400)[0]
    assert all(m.pop("_rollout_continuous") == continuous for m in rows), name
    return [{k: v for k, v in m.items() if not k.startswith(("timing/", "memory/"))}
            for m in rows]


def metrics_at_layouts(tmp_path, world: int, runs: dict) -> dict:
    """``metrics_at`` for several runs on ``world`` ranks in one spawned world (one start-up):
    ``runs`` key -> (layout overrides, continuous); returns key -> metrics."""
    jobs = [(hybrid_checks.ppo_metrics, (str(tmp_path / f"run{i}"), SHORT_RUN + layout),
             {"report_engine": True}) for i, (layout, _) in enumerate(runs.values())]
    out = {}
    for (name, (_, continuous)), ranks in zip(runs.items(),
                                              run_distributed_jobs(jobs, world, timeout=900)):
        rows = ranks[0]
        assert all(m.pop("_rollout_continuous") == continuous for m in rows), name
        out[name] = [{k: v for k, v in m.items() if not k.startswith(("timing/", "memory/"))}
                     for m in rows]
    return out


def assert_same_metrics(got: list[dict], want: list[dict], what: str) -> None:
    assert len(got) == len(want) == 3
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), (what, step, sorted(set(g) ^ set(w)))
        for k in w:
            tol = REL * max(abs(w[k]), abs(g[k])) + ABS_FLOOR
            assert abs(g[k] - w[k]) <= tol, f"{what} step {step + 1} {k}: {g[k]} vs {w[k]}"
    assert any(m["reward/mean"] != want[0]["reward/mean"] for m in want[1:]), \
        "the run did not change anything"
