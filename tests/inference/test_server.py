"""Rollout server (parallel_models.inference.server): the real server as a subprocess on a free
localhost port (TP=1, and TP=2 over gloo via torchrun), driven with a real HTTP client.

- 64 concurrent greedy requests all return, are batched, and equal in-process ``generate``
- text prompts, n samples, seeded sampling reproducible
- bad inputs get their documented 4xx (JSON message) and the server keeps answering correctly
- /update_weights with a changed model: outputs match the new model, version moved once
- clean shutdown (POST /shutdown with the key; SIGTERM for TP=2)
"""

import concurrent.futures

import httpx
import pytest

from parallel_models.distributed import free_port
from parallel_models.testing import run_distributed
from tests.helpers import server_checks
from tests.helpers.server_launch import start_server, stop_server

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_NEW = 8
N_PROMPTS = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return server_checks.served_models(tmp_path_factory.mktemp("serve"), N_PROMPTS, 12, MAX_NEW)


@pytest.fixture(scope="module")
def server(models):
    port = free_port()
    proc = start_server(
        models["paths"][0], port, api_key=KEY, log_path=str(models["root"] / "tp1.log"),
        extra=("--max-prompt-tokens", "64", "--max-new-tokens", "32", "--max-n", "4",
               "--max-body-bytes", "100000", "--batch-window-ms", "20"))
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=60)
    yield {"proc": proc, "client": client, "port": port}
    client.close()
    stop_server(proc)


def _greedy(client, prompt):
    r = client.post("/generate", json={"prompts": [prompt], "greedy": True,
                                       "max_new_tokens": MAX_NEW})
    assert r.status_code == 200, r.text
    s = r.json()["results"][0]["samples"][0]
    return s["token_ids"], s["log_probs"], r.json()["weight_version"]


def _check_against(ref, idx, got):
    ids, logps, _ = got
    assert ids == ref[idx][0], f"prompt {idx}: server {ids} != in-process {ref[idx][0]}"
    assert max((abs(a - b) for a, b in zip(logps, ref[idx][1])), default=0) < 1e-4


def test_health_and_info(server):
    c = server["client"]
    assert httpx.get(f"http://127.0.0.1:{server['port']}/health").json()["status"] == "ok"
    info = c.get("/info").json()
    assert info["tp"] == 1 and info["weight_version"] == 0
    assert info["architecture"] == "LlamaForCausalLM" and info["has_tokenizer"]
    assert info["limits"]["max_n"] == 4
    # the interactive docs and the schema are open without the key; the schema lists the API
    base = f"http://127.0.0.1:{server['port']}"
    assert httpx.get(f"{base}/docs").status_code == 200
    paths = httpx.get(f"{base}/openapi.json").json()["paths"]
    assert {"/generate", "/update_weights", "/v1/completions", "/v1/chat/completions"} <= set(paths)


@pytest.mark.timed  # batching depends on the requests' timing: background_lane.py
def test_concurrent_greedy_matches_inprocess(server, models):
    c = server["client"]
    batches_before = c.get("/info").json()["stats"]["batches"]
    with concurrent.futures.ThreadPoolExecutor(N_PROMPTS) as pool:
        outs = list(pool.map(lambda p: _greedy(c, p), models["prompts"]))
    assert len(outs) == N_PROMPTS
    for i, got in enumerate(outs):
        _check_against(models["ref"][0], i, got)
    batches = c.get("/info").json()["stats"]["batches"] - batches_before
    assert batches < N_PROMPTS, "concurrent requests were not batched together"


def test_text_prompts_n_and_seed(server):
    c = server["client"]
    body = {"prompts": ["hello world", [1, 10, 20]], "n": 3, "max_new_tokens": 6,
            "temperature": 0.8, "top_k": 20, "seed": 123}
    a = c.post("/generate", json=body).json()
    b = c.post("/generate", json=body).json()
    assert a["results"] == b["results"], "seeded sampling is not reproducible"
    assert len(a["results"]) == 2 and all(len(r["samples"]) == 3 for r in a["results"])
    assert a["results"][0]["prompt_token_ids"][0] == 1  # BOS from the tokenizer
    for r in a["results"]:
        for s in r["samples"]:
            assert 1 <= len(s["token_ids"]) <= 6 and len(s["log_probs"]) == len(s["token_ids"])
            assert all(lp <= 0 for lp in s["log_probs"]) and isinstance(s["text"], str)
            assert s["finish_reason"] in ("stop", "length")


BAD = [
    ("malformed_json", "POST", "/generate", b'{"prompts": [', AUTH, 400),
    ("not_json_object", "POST", "/generate", b'[1, 2]', AUTH, 422),
    ("prompts_wrong_type", "POST", "/generate", b'{"prompts": "hi"}', AUTH, 422),
    ("token_wrong_type", "POST", "/generate", b'{"prompts": [[1, "a"]]}', AUTH, 422),
    ("n_wrong_type", "POST", "/generate", b'{"prompts": [[1]], "n": "2"}', AUTH, 422),
    ("unknown_field", "POST", "/generate", b'{"prompts": [[1]], "bogus": 1}', AUTH, 422),
    ("empty_prompts", "POST", "/generate", b'{"prompts": []}', AUTH, 422),
    ("empty_prompt", "POST", "/generate", b'{"prompts": [[]]}', AUTH, 422),
    ("too_many_tokens", "POST", "/generate", b'{"prompts": [[%s]]}' % b",".join([b"5"] * 65),
     AUTH, 422),
    ("n_too_large", "POST", "/generate", b'{"prompts": [[1]], "n": 5}', AUTH, 422),
    ("max_new_too_large", "POST", "/generate", b'{"prompts": [[1]], "max_new_tokens": 33}',
     AUTH, 422),
    ("token_out_of_vocab", "POST", "/generate", b'{"prompts": [[1, 74]]}', AUTH, 422),
    ("negative_temperature", "POST", "/generate", b'{"prompts": [[1]], "temperature": -1}',
     AUTH, 422),
    ("body_too_large", "POST", "/generate", b'{"prompts": [[1]], "pad": "%s"}' % (b"x" * 200000),
     AUTH, 413),
    ("missing_key", "POST", "/generate", b'{"prompts": [[1]]}', {}, 401),
    ("wrong_key", "POST", "/generate", b'{"prompts": [[1]]}', {"Authorization": "Bearer no"},
     401),
    ("wrong_key_info", "GET", "/info", None, {"Authorization": "Bearer no"}, 401),
    ("wrong_method", "GET", "/generate", None, AUTH, 405),
    ("unknown_route", "GET", "/nope", None, AUTH, 404),
    ("update_bad_path", "POST", "/update_weights", b'{"path": "/no/such/folder"}', AUTH, 400),
    ("update_missing_path", "POST", "/update_weights", b'{}', AUTH, 422),
    ("shutdown_no_key", "POST", "/shutdown", None, {}, 401),
]


@pytest.mark.parametrize("name,method,path,body,headers,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input(server, models, name, method, path, body, headers, status):
    url = f"http://127.0.0.1:{server['port']}{path}"
    r = httpx.request(method, url, content=body, timeout=30,
                      headers={**headers, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert isinstance(r.json().get("error"), str) and r.json()["error"]
    # still serving, still correct
    _check_against(models["ref"][0], 0, _greedy(server["client"], models["prompts"][0]))


def test_trainer_rollout_batch(server, models):
    """rollout.backend=server helper: the trainer's batch dict, greedy == in-process."""
    from parallel_models.inference.sampling import SamplingParams
    from parallel_models.inference.server import RolloutClient
    from parallel_models.rl.rollout.server import server_rollout

    ref = models["ref"][0]
    prompts = models["prompts"][:3]
    with RolloutClient(f"http://127.0.0.1:{server['port']}", api_key=KEY) as client:
        assert client.health()["status"] == "ok" and client.info()["tp"] == 1
        batch = server_rollout(client, prompts, SamplingParams(
            n=2, max_new_tokens=MAX_NEW, greedy=True), eos_token_id=server_checks.EOS)
    assert batch["group_index"].tolist() == [0, 0, 1, 1, 2, 2]
    p_max = max(len(p) for p in prompts)
    assert batch["sequences"].shape[0] == 6
    for row in range(6):
        i = row // 2
        p, (ids, logps) = prompts[i], ref[i]
        assert int(batch["prompt_lengths"][row]) == len(p)
        assert batch["sequences"][row, p_max - len(p):p_max].tolist() == p
        k = int(batch["response_mask"][row].sum())
        assert batch["sequences"][row, p_max:p_max + k].tolist() == ids
        assert batch["attention_mask"][row].sum() == len(p) + k
        got = batch["rollout_log_probs"][row, :k].tolist()
        assert max(abs(a - b) for a, b in zip(got, logps)) < 1e-4


def test_chunked_body_too_large(server, models):
    def chunks():  # no Content-Length: streamed (chunked) body over --max-body-bytes
        yield b'{"prompts": [[1]], "pad": "'
        for _ in range(30):
            yield b"x" * 10000
        yield b'"}'

    r = httpx.post(f"http://127.0.0.1:{server['port']}/generate", content=chunks(),
                   headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413, r.text
    assert "body" in r.json()["error"]
    _check_against(models["ref"][0], 1, _greedy(server["client"], models["prompts"][1]))


def test_update_weights(server, models):
    c = server["client"]
    v0 = c.get("/info").json()["weight_version"]
    r = c.post("/update_weights", json={"path": models["paths"][1]})
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == v0 + 1
    assert c.get("/info").json()["weight_version"] == v0 + 1
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda p: _greedy(c, p), models["prompts"][:16]))
    for i, got in enumerate(outs):
        _check_against(models["ref"][1], i, got)
        assert got[2] == v0 + 1


def test_shutdown(server):
    r = server["client"].post("/shutdown")
    assert r.status_code == 200, r.text
    assert server["proc"].wait(30) == 0


def test_tp2_server(models):
    port = free_port()
    proc = start_server(models["paths"][0], port, tp=2, log_path=str(models["root"] / "tp2.log"),
                        torchrun=True)  # the library's own launcher
    try:
        c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        assert c.get("/info").json()["tp"] == 2
        idx = list(range(8))
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda i: _greedy(c, models["prompts"][i]), idx))
        for i, got in zip(idx, outs):
            _check_against(models["ref"][0], i, got)
        assert c.post("/update_weights", json={"path": models["paths"][1]}).json()[
            "weight_version"] == 1
        for i in idx[:4]:
            _check_against(models["ref"][1], i, _greedy(c, models["prompts"][i]))
        assert c.post("/shutdown").status_code == 200  # no key configured: allowed
        c.close()
        rc = proc.wait(60)  # rank 0 tells rank 1 to stop; torchrun exits cleanly
    finally:
        stop_server(proc)
    assert rc == 0, open(models["root"] / "tp2.log").read()[-3000:]


def test_request_timeout_and_sigterm(models):
    import os
    import signal

    port = free_port()
    proc = start_server(models["paths"][0], port, log_path=str(models["root"] / "term.log"),
                        extra=("--request-timeout", "0.001"))
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=60,
                       json={"prompts": [[1, 5]], "max_new_tokens": 30})
        assert r.status_code == 504 and "timed out" in r.json()["error"], r.text
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(30)
    finally:
        stop_server(proc)
    assert rc == 0, open(models["root"] / "term.log").read()[-3000:]


@pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py
def test_ppo_with_server_backend(tmp_path):
    """A short PPO run with rollout.backend=server (weights pushed after every step): completes
    and the reward rises like the in-process default job (tests/rl/test_ppo.py)."""
    import json
    import os

    from parallel_models.rl import trainer
    from parallel_models.tokenizer import build_builtin_tokenizer
    from tests.helpers.ppo_runs import run_ppo

    model = str(tmp_path / "model")
    trainer.build_builtin_model(model, build_builtin_tokenizer(), seed=0)
    port = free_port()
    proc = start_server(model, port, log_path=str(tmp_path / "server.log"))
    try:
        out = str(tmp_path / "run")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        run_ppo([f"trainer.output_dir={out}", "trainer.total_steps=14", "trainer.save_every=0",
                 "trainer.loggers=[jsonl]", "trainer.save_hf_at_end=false", f"model.path={model}",
                 "rollout.backend=server", f"rollout.server_url=http://127.0.0.1:{port}"],
                env=env)
        version = httpx.get(f"http://127.0.0.1:{port}/info", timeout=10).json()["weight_version"]
    finally:
        stop_server(proc)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rewards = [json.loads(line)["reward/mean"] for line in f if line.strip()]
    assert len(rewards) == 14
    assert version == 15, "expected one weight push at start and one after each of 14 steps"
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, f"reward did not rise: {rewards}"


def test_update_weights_is_atomic(models):
    """A read error after some tensors were copied (injected into the loader) leaves the weights
    bit-identical, the version unchanged and the server generating the same greedy tokens."""
    prompt = models["prompts"][0]
    res = run_distributed(server_checks.atomic_update_http, 1, models["paths"], prompt, MAX_NEW)[0]
    assert res["changed_before_error"] > 0, "the injected failure came before any copy"
    assert res["status"] == 400 and "injected read error" in res["error"], res["error"]
    assert res["bit_identical"], "a failed update left a mix of old and new weights"
    assert res["health"] == {"status": "ok", "weight_version": 0}
    assert res["greedy_after_failure"] == res["greedy_before"]
    assert res["greedy_before"][0] == models["ref"][0][0][0]
    assert res["clean_update"] == (200, 1)
    assert res["greedy_new"] == (models["ref"][1][0][0], 1)


def test_update_weights_atomic_across_tp_ranks(models):
    """TP=2: only rank 1 fails to load; both ranks restore (they agree over the group)."""
    prompt = models["prompts"][1]
    ranks = run_distributed(server_checks.atomic_update_tp, 2, models["paths"], prompt, MAX_NEW,
                            1)
    assert ranks[1]["changed_before_error"] > 0
    for r in ranks:
        assert r["raised"] is not None and "kept" in r["raised"], r["raised"]
        assert r["bit_identical"] and r["version"] == 0
        assert r["greedy_after"] == r["greedy_before"] == models["ref"][0][1][0]
