"""Weights streamed to ``parallel-models-serve`` (``POST /update_weights_stream``, no folder):
a push from a PP=2 trainer serves exactly the pushed weights; a push cut short, a tensor of the
wrong shape, a missing or non-finite tensor each leave the old version serving the old weights;
a dead server makes the trainer fail with an error naming it."""

import pytest

from parallel_models.distributed import free_port
from parallel_models.inference.server.client import RolloutClient, ServerError
from parallel_models.inference.server.weight_stream import bucket_frame, end_frame
from parallel_models.testing import run_distributed
from tests.helpers import hybrid_checks
from tests.helpers import server_checks
from tests.helpers.ppo_runs import load_folder
from tests.helpers.server_launch import start_server, stop_server

MAX_NEW = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    models = server_checks.served_models(tmp_path_factory.mktemp("push"), 6, 10, MAX_NEW)
    root, paths, prompts, ref = (models[k] for k in ("root", "paths", "prompts", "ref"))
    port = free_port()
    proc = start_server(paths[0], port, log_path=str(root / "server.log"))
    client = RolloutClient(f"http://127.0.0.1:{port}", timeout=60)
    yield {"paths": paths, "prompts": prompts, "ref": ref, "client": client, "port": port,
           "root": root}
    client.close()
    stop_server(proc)


def _greedy(s):
    out = s["client"].generate(s["prompts"], greedy=True, max_new_tokens=MAX_NEW,
                               eos_token_id=2, return_text=False)
    return ([(r["samples"][0]["token_ids"], r["samples"][0]["log_probs"]) for r in
             out["results"]], out["weight_version"])


def _serves(s, which: int) -> int:
    got, version = _greedy(s)
    for (ids, logps), (want_ids, want_logps) in zip(got, s["ref"][which]):
        assert ids == want_ids
        assert max((abs(a - b) for a, b in zip(logps, want_logps)), default=0) < 1e-4
    return version


def _frames(tensors, end=True):
    names = list(tensors)
    for half in (names[: len(names) // 2], names[len(names) // 2:]):
        yield from bucket_frame({n: tensors[n] for n in half})
    if end:
        yield end_frame(len(tensors))


def test_push_from_pp2_serves_the_pushed_weights(served):
    before = _serves(served, 0)
    url = f"http://127.0.0.1:{served['port']}"
    out = run_distributed(hybrid_checks.push_from_layout, 2, served["paths"][1], url, 1, 2, None)
    assert [o.get("version") for o in out] == [before + 1] * 2, out
    assert _serves(served, 1) == before + 1
    # and back, through the raw client (every later test starts from model 0)
    served["client"].push_weight_stream(_frames(load_folder(served["paths"][0])))
    _serves(served, 0)


@pytest.mark.parametrize("damage,message", [
    ("cut", "cut short"), ("shape", "shape"), ("missing", "missing"), ("nan", "non-finite")])
def test_bad_push_keeps_old_weights(served, damage, message):
    version = _serves(served, 0)
    tensors = load_folder(served["paths"][1])
    name = "model.layers.1.self_attn.q_proj.weight"
    if damage == "shape":
        tensors[name] = tensors[name][:-1]
    elif damage == "missing":
        del tensors[name]
    elif damage == "nan":
        tensors[name] = tensors[name].clone()
        tensors[name][3, 5] = float("nan")
    with pytest.raises(ServerError) as err:
        served["client"].push_weight_stream(_frames(tensors, end=damage != "cut"))
    assert err.value.status == 400 and message in err.value.message, err.value.message
    assert damage == "cut" or damage == "nan" or name in err.value.message
    assert _serves(served, 0) == version  # old version, old weights


def test_tp2_server_stream_equals_folder_load(served):
    """At server TP=2 the pushed tensors reach both ranks: the same samples and log-probs as
    loading the same weights from their folder."""
    port = free_port()
    proc = start_server(served["paths"][0], port, tp=2, log_path=str(served["root"] / "tp2.log"))
    client = RolloutClient(f"http://127.0.0.1:{port}", timeout=60)
    try:
        s = dict(served, client=client)
        _serves(s, 0)
        assert client.push_weight_stream(_frames(load_folder(served["paths"][1])))[
            "weight_version"] == 1
        streamed = _greedy(s)[0]
        client.update_weights(served["paths"][1])
        assert _greedy(s)[0] == streamed
        _serves(s, 1)
    finally:
        client.close()
        stop_server(proc)


def test_dead_server_fails_clearly(served, tmp_path):
    import socket

    with socket.socket() as held:  # bound, never listening: connections are refused (a killed
        held.bind(("127.0.0.1", 0))  # server), and no other process can take the port meanwhile
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        out = run_distributed(hybrid_checks.push_from_layout, 1, served["paths"][1], url, 1, 1,
                              str(tmp_path / "fallback"))[0]
    assert "error" in out and url in out["error"], out
    assert "stream push failed first" in out["error"] and "previous weights" in out["error"]


def test_ppo_pp2_with_server_backend_equals_inprocess_pp1(served, tmp_path):
    """3 greedy PPO steps at PP=2 with rollout.backend=server (weights streamed at the start and
    after every step) give the metrics of the in-process PP=1 run, with one server request per
    step (not one per pipeline stage). Runs last: it leaves the
    server on the trained weights."""
    from tests.helpers.hybrid_ppo_runs import assert_same_metrics, metrics_at

    version = _serves(served, 0)
    requests = served["client"].info()["stats"]["requests"]
    common = [f"model.path={served['paths'][0]}", "data.max_prompt_length=16"]
    want = metrics_at(tmp_path, 1, common, "inprocess")
    got = metrics_at(tmp_path, 2, common + [
        "parallel.pipeline_parallel_size=2", "rollout.backend=server",
        f"rollout.server_url=http://127.0.0.1:{served['port']}"], "server")
    assert_same_metrics(got, want, "PP=2 with the server backend")
    assert served["client"].health()["weight_version"] == version + 4  # start + 3 steps
    # one /generate per step: only the first rank of the replica's TP x PP group asks
    assert served["client"].info()["stats"]["requests"] - requests == 3
