"""Sampled PPO through the rollout server (``rollout.backend=server``) at DP=2 draws the tokens
of the in-process run on one rank (the trainer's per-prompt seeds travel as ``prompt_seeds``;
the server batches continuously), and their metrics agree within rel 1e-5."""

import pytest

from parallel_models.distributed import free_port
from parallel_models.testing import run_distributed_jobs
from tests.helpers import sampled_ppo_runs as runs
from tests.helpers import server_checks
from tests.helpers.server_launch import start_server, stop_server


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampled_server")
    path = server_checks.tiny_builtin_model(str(root / "model"), seed=1)
    common = (f"model.path={path}", "data.max_prompt_length=16")
    port = free_port()
    proc = start_server(path, port, log_path=str(root / "server.log"))
    try:
        served = run_distributed_jobs([(runs.sampled_run, (str(root / "server"), [
            "rollout.backend=server", f"rollout.server_url=http://127.0.0.1:{port}"]),
            {"steps": 2, "extra": common})], 2, timeout=600)[0]
    finally:
        stop_server(proc)
    local = run_distributed_jobs([(runs.sampled_run, (str(root / "local"), []),
                                   {"steps": 2, "extra": common})], 1, timeout=600)[0]
    return {"server": served, "local": local}


def test_server_rollout_at_dp2_draws_the_in_process_tokens(results):
    want = runs.merged_tokens(results["local"])
    assert [sorted(s) for s in want] == [[0, 1, 2, 3]] * 2
    assert runs.merged_tokens(results["server"]) == want
    for step, (g, w) in enumerate(zip(results["server"][0]["metrics"],
                                      results["local"][0]["metrics"])):
        assert g.keys() == w.keys(), sorted(set(g) ^ set(w))
        for k in w:
            tol = 1e-5 * max(abs(w[k]), abs(g[k])) + 1e-6
            assert abs(g[k] - w[k]) <= tol, f"step {step + 1} {k}: {g[k]} vs {w[k]}"
