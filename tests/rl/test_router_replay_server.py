"""The rollout server returns MoE routes when asked (``"return_routes": true`` on /generate):
the trainer's ``server_rollout`` batch carries them as the in-process engine records them
(greedy, same prompts: equal tokens and equal routes, compact dtype), with continuous batching
(such a request waits for the running rows, then runs through the static generator) and with
--static-batching; a dense model answers 422 with the reason."""

import httpx
import pytest

from parallel_models.distributed import free_port
from parallel_models.testing import run_distributed, save_tiny_hf_model
from tests.helpers import router_replay_checks as checks
from tests.helpers.server_launch import start_server, stop_server

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
MAX_NEW = 6


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    path = save_tiny_hf_model(str(tmp_path_factory.mktemp("replay_server") / "moe"),
                              "qwen3_moe", seed=1)
    ref = run_distributed(checks.inprocess_greedy_routes, 1, path, PROMPTS, MAX_NEW)[0]
    return path, ref


@pytest.fixture(scope="module", params=["continuous", "static"])
def moe_server(moe_model, tmp_path_factory, request):
    path, ref = moe_model
    port = free_port()
    extra = ("--static-batching",) if request.param == "static" else ()
    proc = start_server(path, port, extra=extra, log_path=str(
        tmp_path_factory.mktemp("log") / "server.log"))
    yield {"ref": ref, "url": f"http://127.0.0.1:{port}"}
    stop_server(proc)


def test_server_rollout_returns_the_routes_the_engine_records(moe_server):
    from parallel_models.inference.sampling import SamplingParams
    from parallel_models.inference.server import RolloutClient
    from parallel_models.rl.rollout.server import server_rollout

    ref = moe_server["ref"]
    with RolloutClient(moe_server["url"]) as client:
        batch = server_rollout(client, PROMPTS, SamplingParams(
            max_new_tokens=MAX_NEW, greedy=True, ignore_eos=True), num_experts=4)
        plain = server_rollout(client, PROMPTS, SamplingParams(
            max_new_tokens=MAX_NEW, greedy=True, ignore_eos=True))
    assert "routes" not in plain
    assert batch["sequences"].tolist() == ref["sequences"].tolist()
    assert batch["routes"].dtype == ref["routes"].dtype
    assert batch["routes"].shape == ref["routes"].shape == (3, 5 + MAX_NEW, 2, 2)
    assert batch["routes"].tolist() == ref["routes"].tolist()
    assert (batch["routes"][:, -1] == 255).all()  # the last token never went through the model


def test_dense_server_refuses_return_routes(tmp_path):
    path = save_tiny_hf_model(str(tmp_path / "dense"), "llama", seed=1)
    port = free_port()
    proc = start_server(path, port, log_path=str(tmp_path / "server.log"))
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=60,
                       json={"prompts": [[5, 6]], "max_new_tokens": 2, "return_routes": True})
        assert r.status_code == 422 and "return_routes" in r.json()["error"], r.text
    finally:
        stop_server(proc)
