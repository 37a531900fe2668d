"""Fuzz of the rollout server's HTTP API (issue 30): one real server (subprocess, tiny Llama,
loopback) gets >= 1,000 seeded random malformed bodies spread over every endpoint (mutated
valid requests, random bytes, wrong JSON types, huge / non-finite numbers, lone surrogates,
deep nesting, wrong content types and keys). None may get a 5xx; the server must stay up and
answer a greedy request afterwards with the same tokens as before, on the same weights.

Bounded: small limits (4 new tokens, 64 KiB bodies), ~1,050 requests, well under a minute.
"""

import json
import random

import httpx
import pytest

from parallel_models.distributed import free_port
from tests.helpers import server_checks
from tests.helpers.server_launch import start_server, stop_server

KEY = "fuzz-key"
REQUESTS = 1050
SEED = 30
GREEDY = {"prompts": [[1, 10, 20, 30]], "greedy": True, "max_new_tokens": 4}


def _templates(model: str) -> dict:
    """A valid body per POST endpoint (the fuzzer mutates them)."""
    return {
        "/generate": {"prompts": [[1, 5, 6], "hello"], "max_new_tokens": 2, "greedy": False,
                      "n": 1, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3,
                      "stop_token_ids": [2], "eos_token_id": 2, "ignore_eos": False,
                      "return_text": True, "return_routes": False},
        "/v1/completions": {"model": model, "prompt": "hello", "max_tokens": 2,
                            "temperature": 0.5, "n": 1, "logprobs": 2, "stop": ["x"],
                            "seed": 1, "stream": False},
        "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 2, "logprobs": True, "top_logprobs": 2,
                                 "stream": False},
        "/update_weights": {"path": "/no/such/folder"},
        "/weights_group/init": {"master_addr": "127.0.0.1", "master_port": 1, "world_size": 3,
                                "transport": "gloo", "timeout_s": 1},
        "/weights_group/update": {"buckets": [{"tensors": [["model.embed_tokens.weight",
                                                            "float32", [74, 64]]],
                                               "nbytes": 18944}], "push_id": "x"},
    }


GETS = ("/health", "/info", "/v1/models", "/v1/models/x", "/weights_group/status", "/docs",
        "/openapi.json")


def _value(rng: random.Random, depth: int = 0):
    """A random JSON-ish value (as text, so non-standard pieces can be included)."""
    kinds = ["int", "bigint", "float", "weird", "str", "surrogate", "null", "bool", "list",
             "object", "deep"]
    kind = rng.choice(kinds if depth < 3 else kinds[:8])
    if kind == "int":
        return str(rng.randint(-5, 100))
    if kind == "bigint":
        return rng.choice([str(1 << 62), str(1 << 63), str(1 << 100), "-" + "9" * 30, "1" + "0" * 5000])
    if kind == "float":
        return repr(rng.choice([0.0, -0.0, 1e-320, 1e30, 1e308, 2.5, -1.5, 3e38]))
    if kind == "weird":
        return rng.choice(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "01", "1.", ".5",
                           "0x10", "+1", "tru", "nul", "undefined"])
    if kind == "str":
        chars = [chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000), 0x1F600,
                                 0, 0x202E])) for _ in range(rng.randrange(0, 20))]
        return json.dumps("".join(chars))
    if kind == "surrogate":
        return rng.choice(['"a\\ud800b"', '"\\udfff"', '"\\ud83d"', '"x\\ud800\\ud800"'])
    if kind == "null":
        return "null"
    if kind == "bool":
        return rng.choice(["true", "false"])
    if kind == "list":
        return "[" + ",".join(_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))) + "]"
    if kind == "object":
        return "{" + ",".join(f'{json.dumps(rng.choice(["a", "n", "prompts", ""]))}:'
                              f'{_value(rng, depth + 1)}' for _ in range(rng.randrange(0, 3))) + "}"
    n = rng.choice([50, 900, 2000, 20000])
    return "[" * n + "]" * n


def _body(rng: random.Random, template: dict | None) -> bytes:
    """One malformed (rarely valid) body for an endpoint with ``template``."""
    kind = rng.randrange(8)
    if template is None or kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 120)))
    text = json.dumps(template)
    if kind == 1:  # cut short
        return text[:rng.randrange(len(text))].encode()
    if kind == 2:  # a random value for a random field (or a nested one)
        key = rng.choice(list(template))
        items = [f"{json.dumps(k)}: {_value(rng) if k == key else json.dumps(v)}"
                 for k, v in template.items()]
        return ("{" + ", ".join(items) + "}").encode()
    if kind == 3:  # an extra field
        return (text[:-1] + f', {json.dumps(rng.choice(["bogus", "", "__proto__", "n"]))}: '
                f'{_value(rng)}}}').encode()
    if kind == 4:  # a field left out
        drop = rng.choice(list(template))
        return json.dumps({k: v for k, v in template.items() if k != drop}).encode()
    if kind == 5:  # not an object
        return _value(rng).encode()
    if kind == 6:  # invalid UTF-8 inside a string
        return text.replace('"', '"\xff\xfe', 1).encode("latin-1", "replace")
    return text.encode()  # valid (the limits and checks still apply)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    model = server_checks.tiny_builtin_model(str(root / "model"), 1)
    port = free_port()
    proc = start_server(model, port, api_key=KEY, log_path=str(root / "server.log"),
                        extra=("--max-new-tokens", "4", "--max-prompt-tokens", "32",
                               "--max-n", "2", "--max-batch", "8", "--max-body-bytes", "65536",
                               "--static-batching"))
    yield {"proc": proc, "port": port, "model": model, "log": root / "server.log"}
    stop_server(proc)


def test_fuzz_http_api(server):
    base = f"http://127.0.0.1:{server['port']}"
    auth = {"Authorization": f"Bearer {KEY}"}
    rng = random.Random(SEED)
    templates = _templates(server["model"])
    endpoints = [("POST", p) for p in templates] + [("POST", "/update_weights_stream"),
                                                    ("POST", "/shutdown")]
    endpoints += [("GET", p) for p in GETS]
    with httpx.Client(base_url=base, timeout=60) as client:
        before = client.post("/generate", json=GREEDY, headers=auth).json()
        seen: dict[tuple, int] = {}
        failures = []
        for i in range(REQUESTS):
            method, path = endpoints[i % len(endpoints)]
            body = _body(rng, templates.get(path))
            headers = {"Content-Type": "application/octet-stream"
                       if path == "/update_weights_stream" else "application/json"}
            if path == "/shutdown":  # never a request that may stop it: no key or not JSON
                headers = rng.choice([{"Content-Type": "text/plain", **auth},
                                      {"Content-Type": "application/json"}])
            else:
                headers.update(auth if rng.random() < 0.9 else
                               rng.choice([{}, {"Authorization": "Bearer nope"}]))
                if rng.random() < 0.1:
                    headers["Content-Type"] = rng.choice([
                        "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                        "application/json; charset=latin-1", ""])
            r = client.request(method, path, content=body, headers=headers)
            seen[(path, r.status_code)] = seen.get((path, r.status_code), 0) + 1
            if r.status_code >= 500:
                failures.append((method, path, body[:200], r.status_code, r.text[:300]))
        assert not failures, f"{len(failures)} 5xx answers, e.g. {failures[:3]}"
        assert server["proc"].poll() is None, "the server died"
        assert client.get("/health").json()["status"] == "ok"
        after = client.post("/generate", json=GREEDY, headers=auth).json()
    assert after == before, "a greedy request answers differently after the fuzzing"
    statuses = {s for (_, s) in seen}
    assert {400, 401, 415, 422} <= statuses, seen  # the fuzzer reached the parsers and checks
    assert sum(seen.values()) >= 1000 and len({p for (p, _) in seen}) == len(endpoints)
