"""``rollout.weight_push: group`` in PPO: a run pushing over the weights group (gloo) gives the
metrics of a run streaming over HTTP; a server killed mid-push makes the trainer fall back to
the folder and fail with an error naming the server and the group push (no hang)."""

import pytest

from parallel_models.distributed import free_port
from parallel_models.inference.server.client import RolloutClient
from parallel_models.testing import run_distributed
from tests.helpers import server_checks
from tests.helpers import weight_group_checks
from tests.helpers.server_launch import start_server, stop_server

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("group_ppo")
    path = server_checks.tiny_builtin_model(str(root / "m1"), seed=1)
    port = free_port()
    proc = start_server(path, port, log_path=str(root / "server.log"))
    client = RolloutClient(f"http://127.0.0.1:{port}", timeout=60)
    yield {"paths": [path], "client": client, "url": f"http://127.0.0.1:{port}"}
    client.close()
    stop_server(proc)


def test_server_killed_mid_push_fails_clearly(served, tmp_path):
    """The server dies between two buckets: the trainer does not hang; it falls back to the
    folder, which fails too, and every rank raises an error naming the server and the group
    push."""
    port = free_port()
    proc = start_server(served["paths"][0], port, log_path=str(tmp_path / "doomed.log"))
    try:
        url = f"http://127.0.0.1:{port}"
        out = run_distributed(weight_group_checks.push_group, 1, served["paths"][0], url,
                              kill_after_buckets=2, kill_pid=proc.pid,
                              fallback_folder=str(tmp_path / "fallback"))[0]
    finally:
        stop_server(proc)
    assert "group push failed first" in out.get("error", "") and url in out["error"], out


def test_ppo_group_push_equals_stream_push(served, tmp_path):
    """3 greedy PPO steps with the server backend: weight_push=group gives the metrics of
    weight_push=stream (rel <= 1e-6), and pushes at the start and after every step."""
    from tests.helpers.hybrid_ppo_runs import metrics_at

    version = served["client"].health()["weight_version"]
    common = [f"model.path={served['paths'][0]}", "data.max_prompt_length=16",
              "rollout.backend=server", f"rollout.server_url={served['url']}"]
    want = metrics_at(tmp_path, 1, common + ["rollout.weight_push=stream"], "stream")
    got = metrics_at(tmp_path, 1, common + ["rollout.weight_push=group"], "group")
    assert len(got) == len(want) == 3
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for k in w:
            assert abs(g[k] - w[k]) <= 1e-6 * max(abs(w[k]), abs(g[k])) + 1e-12, (step, k)
    assert any(m["reward/mean"] != want[0]["reward/mean"] for m in want[1:]), "nothing changed"
    assert served["client"].health()["weight_version"] == version + 8  # 2 runs x (start + 3)
    status = served["client"].weights_group("status")  # pushed over the group, no fallback
    assert status["transport"] == "gloo", status
    assert status["last_push"]["ok"] and status["last_push"]["weight_version"] == version + 8
