"""``rollout.weight_push: group`` on the CPU (gloo): the trainer's rank 0 and the server's ranks
join a process group beside their own worlds and the actor is broadcast bucket by bucket. A push
serves exactly what loading the same folder serves (bit for bit: equal log-probs) and bumps
the version; a NaN weight or a trainer killed midway leaves the old version serving the old
weights, and the next trainer joins afresh; a PPO run pushing over the group equals one
streaming over HTTP."""

import pytest

from parallel_models.distributed import free_port
from parallel_models.rl.rollout.server.client import RolloutClient
from parallel_models.rl.rollout.server.launch import start_server, stop_server
from parallel_models.rl.rollout.server.side_group import pick_transport
from parallel_models.testing import run_distributed
from tests import server_checks, weight_group_checks

MAX_NEW = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    models = server_checks.served_models(tmp_path_factory.mktemp("group"), 6, 10, MAX_NEW)
    port = free_port()
    proc = start_server(models["paths"][0], port, log_path=str(models["root"] / "server.log"))
    client = RolloutClient(f"http://127.0.0.1:{port}", timeout=60)
    yield dict(models, client=client, url=f"http://127.0.0.1:{port}")
    client.close()
    stop_server(proc)


def _greedy(client, prompts):
    out = client.generate(prompts, greedy=True, max_new_tokens=MAX_NEW, eos_token_id=2,
                          return_text=False)
    return ([(r["samples"][0]["token_ids"], r["samples"][0]["log_probs"]) for r in
             out["results"]], out["weight_version"])


def _serves(s, which: int) -> int:
    got, version = _greedy(s["client"], s["prompts"])
    for (ids, logps), (want_ids, want_logps) in zip(got, s["ref"][which]):
        assert ids == want_ids
        assert max((abs(a - b) for a, b in zip(logps, want_logps)), default=0) < 1e-4
    return version


def _push(s, which: int, world: int = 1, pp: int = 1, **kw) -> dict:
    return run_distributed(weight_group_checks.push_group, world, s["paths"][which], s["url"],
                           1, pp, **kw)[0]


def test_pick_transport():
    cpu, gpu0, gpu1 = [0, 0, 0], [1, 5, 6], [1, 7, 8]
    assert pick_transport([cpu, cpu]) == "gloo"
    assert pick_transport([gpu0, cpu]) == "gloo"
    assert pick_transport([gpu0, gpu1]) == "nccl"
    assert pick_transport([gpu0, gpu0]) == "ipc"
    assert pick_transport([gpu0, gpu0, gpu1]) == "gloo"  # mixed: neither NCCL nor IPC works
    with pytest.raises(ValueError, match="nccl"):
        pick_transport([gpu0, gpu0], "nccl")


def test_group_push_from_pp2_equals_folder_load(served):
    """Two pushes from a PP=2 trainer over one group (the second reuses it): each bumps the
    version; the served log-probs equal those after loading the same folder, exactly."""
    before = _serves(served, 0)
    out = _push(served, 1, world=2, pp=2, pushes=2)
    assert out.get("versions") == [before + 1, before + 2] and out["transport"] == "gloo", out
    pushed, version = _greedy(served["client"], served["prompts"])
    assert version == before + 2
    served["client"].update_weights(served["paths"][1])
    assert _greedy(served["client"], served["prompts"])[0] == pushed  # bit for bit
    _serves(served, 1)
    assert _push(served, 0)["versions"] == [before + 4]  # a new trainer joins afresh
    _serves(served, 0)


def test_nan_weight_keeps_old_version(served):
    version = _serves(served, 0)
    out = _push(served, 1, poison=True)
    assert "non-finite" in out.get("error", ""), out
    assert _serves(served, 0) == version  # old version, old weights
    status = served["client"].weights_group("status")
    assert status["joined"] and status["last"]["ok"] is False


def test_trainer_killed_mid_push_keeps_old_version(served):
    version = _serves(served, 0)
    with pytest.raises(RuntimeError, match="exited with code -9"):
        _push(served, 1, kill_after_buckets=2)
    assert _serves(served, 0) == version
    assert _push(served, 1)["versions"] == [version + 1]  # the server still takes pushes
    _serves(served, 1)
    assert _push(served, 0)["versions"] == [version + 2]


def test_dead_server_falls_back_clearly(served, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    out = run_distributed(weight_group_checks.push_group, 1, served["paths"][1], url,
                          fallback_folder=str(tmp_path / "fallback"))[0]
    assert "group push failed first" in out.get("error", "") and url in out["error"], out


def test_ppo_group_push_equals_stream_push(served, tmp_path):
    """3 greedy PPO steps with the server backend: weight_push=group gives the metrics of
    weight_push=stream (rel <= 1e-6), and pushes at the start and after every step."""
    from tests.hybrid_ppo_runs import metrics_at

    version = _serves(served, 0)
    common = [f"model.path={served['paths'][0]}", "data.max_prompt_length=16",
              "rollout.backend=server", f"rollout.server_url={served['url']}"]
    want = metrics_at(tmp_path, 1, common + ["rollout.weight_push=stream"], "stream")
    got = metrics_at(tmp_path, 1, common + ["rollout.weight_push=group"], "group")
    assert len(got) == len(want) == 3
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for k in w:
            assert abs(g[k] - w[k]) <= 1e-6 * max(abs(w[k]), abs(g[k])) + 1e-12, (step, k)
    assert served["client"].health()["weight_version"] == version + 8  # 2 runs x (start + 3)
    assert served["client"].weights_group("status")["transport"] == "gloo"
