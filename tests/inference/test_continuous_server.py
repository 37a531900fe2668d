"""The rollout server with continuous batching (its default), a real subprocess on CPU: requests
sent while another decodes join the running batch and come back before it, each equal to its
in-process greedy result alone; a request over the KV budget gets 4xx at once (native 422, and
400 through the ``openai`` client, streamed or not); n samples and repeated prompts share a
prefill (the prompt LRU)."""

import concurrent.futures
import time

import httpx
import openai
import pytest

from parallel_models.distributed import free_port
from parallel_models.testing import run_distributed
from tests.helpers import server_checks
from tests.helpers.server_launch import start_server, stop_server

BUDGET = 1500
LONG = 240


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("cserve")
    path = server_checks.tiny_builtin_model(str(root / "tiny"), seed=1)
    port = free_port()
    proc = start_server(path, port, log_path=str(root / "server.log"),
                        extra=("--kv-budget-tokens", str(BUDGET), "--max-batch", "8",
                               "--max-new-tokens", str(LONG), "--prefix-cache-tokens", "256"))
    base = f"http://127.0.0.1:{port}"
    native = httpx.Client(base_url=base, timeout=120)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    yield {"native": native, "client": client, "path": path}
    native.close()
    client.close()
    stop_server(proc)


def _greedy(native, prompt, max_new, **extra):
    r = native.post("/generate", json={"prompts": [prompt], "greedy": True,
                                       "max_new_tokens": max_new, "return_text": False, **extra})
    assert r.status_code == 200, r.text
    return r.json()["results"][0]["samples"]


def _stats(native):
    return native.get("/info").json()["stats"]


@pytest.mark.timed  # its limits hold with the background stopped: background_lane.py
def test_requests_join_a_running_batch(served):
    native = served["native"]
    shorts = [[5 + i, 9, 11 + i, 3] for i in range(6)]
    long_prompt = [7, 8, 9]
    _greedy(native, shorts[0], 2)  # warm
    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        long = pool.submit(_greedy, native, long_prompt, LONG, ignore_eos=True, n=4)
        deadline = time.monotonic() + 60
        while _stats(native).get("running_rows", 0) == 0:  # wait until the long one decodes
            assert not long.done() and time.monotonic() < deadline
            time.sleep(0.005)
        got = list(pool.map(lambda p: _greedy(native, p, 8)[0], shorts))
        assert not long.done(), "short requests waited for the running batch to finish"
        long_samples = long.result()
    assert [len(s["token_ids"]) for s in long_samples] == [LONG] * 4
    ref = run_distributed(server_checks.reference_greedy, 1, [served["path"]], shorts, 8)[0][0]
    for (tokens, logps), s in zip(ref, got):
        assert s["token_ids"] == tokens
        assert max(abs(a - b) for a, b in zip(s["log_probs"], logps)) <= 1e-4


def test_request_over_kv_budget_is_refused_at_once(served):
    native, client = served["native"], served["client"]
    prompt = [5, 6, 7, 8]
    r = native.post("/generate", json={"prompts": [prompt], "n": 8, "max_new_tokens": LONG})
    assert r.status_code == 422 and "KV budget is 1500 tokens" in r.json()["error"]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=served["path"], prompt=prompt, n=8,
                                      max_tokens=LONG, stream=stream)
        assert err.value.status_code == 400 and "KV budget" in str(err.value)
    assert _greedy(native, prompt, 4)  # still serving


def test_n_samples_and_repeated_prompts_share_prefill(served):
    native = served["native"]
    prompt = [12, 13, 14, 15, 16]
    before = _stats(native)
    three = _greedy(native, prompt, 6, n=3)
    mid = _stats(native)
    assert mid["prompts_prefilled"] - before["prompts_prefilled"] == 1
    assert len({tuple(s["token_ids"]) for s in three}) == 1
    again = _greedy(native, prompt, 6)
    after = _stats(native)
    assert after["prompts_prefilled"] == mid["prompts_prefilled"]  # served from the LRU
    assert after["prefix_cache_hits"] == mid["prefix_cache_hits"] + 1
    assert again[0]["token_ids"] == three[0]["token_ids"]
