"""``rollout.weight_push: group`` on the CPU (gloo): the trainer's rank 0 and the server's ranks
join a process group beside their own worlds and the actor is broadcast bucket by bucket. A push
serves exactly what loading the same folder serves (bit for bit: equal log-probs) and bumps
the version; a NaN weight or a trainer killed midway leaves the old version serving the old
weights, and the next trainer joins afresh (PPO over the group: test_weight_group_ppo.py). The
server runs with ``--partial-rollouts``: a push landing while requests are in flight lets them go
on under the new weights (``Engine.swap_in_flight``), each token under the version that drew it."""

import pytest

from parallel_models.distributed import free_port
from parallel_models.inference.server.client import RolloutClient
from parallel_models.inference.server.side_group import pick_transport
from parallel_models.testing import run_distributed
from tests.helpers import server_checks
from tests.helpers import weight_group_checks
from tests.helpers.server_launch import start_server, stop_server

MAX_NEW = 6
IN_FLIGHT_NEW = 10  # the in-flight test's response length


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    models = server_checks.served_models(tmp_path_factory.mktemp("group"), 6, 10, MAX_NEW)
    port = free_port()
    proc = start_server(models["paths"][0], port, log_path=str(models["root"] / "server.log"),
                        extra=("--partial-rollouts",))
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
    served["client"].update_weights(served["paths"][0])  # the next test starts from model 0
    _serves(served, 0)


def test_nan_weight_keeps_old_version(served):
    version = _serves(served, 0)
    out = _push(served, 1, poison=True)
    assert "non-finite" in out.get("error", ""), out
    assert _serves(served, 0) == version  # old version, old weights
    status = served["client"].weights_group("status")
    assert status["joined"] and status["last_push"]["ok"] is False  # the group is kept


def test_trainer_killed_mid_push_keeps_old_version(served):
    version = _serves(served, 0)
    with pytest.raises(RuntimeError, match="exited with code -9"):
        _push(served, 1, kill_after_buckets=2)
    assert _serves(served, 0) == version
    assert _push(served, 1)["versions"] == [version + 1]  # the server still takes pushes
    _serves(served, 1)
    served["client"].update_weights(served["paths"][0])  # the next test starts from model 0


def test_bad_requests_are_refused_at_once(served):
    """A manifest that does not fit the model, or a group of the wrong size, is a 400 naming the
    problem before any byte moves (nothing queued: the server keeps serving its version)."""
    from parallel_models.inference.server.client import ServerError
    from tests.helpers.ppo_runs import load_folder

    version = _serves(served, 0)
    tensors = load_folder(served["paths"][0])
    entries = [[n, "float32", list(t.shape)] for n, t in tensors.items()]
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    bad_shape = [list(e) for e in entries]
    bad_shape[3][2] = [e + 1 for e in bad_shape[3][2]]
    cases = [({"buckets": [{"tensors": entries[1:], "nbytes": nbytes - tensors[entries[0][0]]
                            .numel() * 4}]}, "missing"),
             ({"buckets": [{"tensors": bad_shape, "nbytes": nbytes}]}, "nbytes says"),
             ({"buckets": [{"tensors": entries, "nbytes": nbytes}], "extra": 1}, "invalid")]
    for manifest, message in cases:
        with pytest.raises(ServerError) as err:
            served["client"].weights_group("update", manifest)
        assert err.value.status == 400 and message in err.value.message, err.value.message
    with pytest.raises(ServerError, match="world_size 5"):
        served["client"].weights_group("init", {"master_addr": "127.0.0.1", "master_port": 1,
                                                "world_size": 5})
    assert _serves(served, 0) == version


def test_push_lands_while_rows_are_in_flight(served):
    """``--partial-rollouts``: a group push that lands while a request's rows are in flight (the
    request queued between two pushes on purpose: ``weight_group_checks.push_while_in_flight``)
    does not abort them: they finish under the new weights, every token recorded with the
    version that drew it (two versions in each sample), each token the greedy choice and its
    behaviour log-prob the log-prob of that version's weights, per transformers over the whole
    sample (so the KV of the prefix was recomputed at the swap)."""
    version = _serves(served, 0)
    prompts = served["prompts"][:3]
    out = run_distributed(weight_group_checks.push_while_in_flight, 1, *served["paths"],
                          served["url"], prompts, IN_FLIGHT_NEW)[0]
    assert "error" not in out, out
    old, new = out["versions"]
    assert (old, new) == (version + 1, version + 2) and out["weight_version"] == new, out
    assert len(out["samples"]) == len(prompts)
    for s in out["samples"]:
        assert s["finish_reason"] == "length" and len(s["token_ids"]) == IN_FLIGHT_NEW, s
        # push 1's weights drew the prefill's token and the decode step's queued ahead of the swap
        assert s["weight_versions"] == [old] * 2 + [new] * (IN_FLIGHT_NEW - 2), s
        assert s["token_ids"] == s["greedy"], s
        assert len(s["recomputed"]) == IN_FLIGHT_NEW
        for got, want in zip(s["log_probs"], s["recomputed"]):
            assert abs(got - want) <= 1e-4 + 1e-4 * abs(want), (s["log_probs"], s["recomputed"])
    served["client"].update_weights(served["paths"][0])  # the next test starts from model 0
    _serves(served, 0)
