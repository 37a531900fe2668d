"""Helpers for the rollout-server tests: in-process reference generation."""

from __future__ import annotations


import torch

EOS = 2  # the builtin tokenizer's </s>, which the server uses as eos by default


def tiny_builtin_model(path: str, seed: int) -> str:
    """A tiny Llama with the built-in tokenizer (and its vocab) saved at ``path``."""
    from parallel_models.tokenizer import build_builtin_tokenizer
    from parallel_models.testing import save_tiny_hf_model

    save_tiny_hf_model(path, "llama", seed=seed, vocab_size=74)  # the builtin tokenizer's vocab
    build_builtin_tokenizer().save_pretrained(path)
    return path


def served_models(root, n_prompts: int, max_prompt: int, max_new_tokens: int) -> dict:
    """Two tiny Llamas (seeds 1 and 2) with the built-in tokenizer under ``root``, ``n_prompts``
    seeded random prompts, and each model's greedy answers to them (the servers' oracle)."""
    import random

    from parallel_models.testing import run_distributed

    paths = [tiny_builtin_model(str(root / f"m{seed}"), seed) for seed in (1, 2)]
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(4, 74) for _ in range(rng.randrange(1, max_prompt))]
               for _ in range(n_prompts)]
    ref = run_distributed(reference_greedy, 1, paths, prompts, max_new_tokens)[0]
    return {"paths": paths, "prompts": prompts, "ref": ref, "root": root}


def reference_greedy(paths: list[str], prompts: list[list[int]], max_new_tokens: int) -> list:
    """For each model folder: greedy responses (token ids, log-probs) of each prompt generated
    alone, in-process (TP=1)."""
    import parallel_models as pm
    from parallel_models.llama.checkpoint_utils.loader import load_hf_weights
    from parallel_models.inference.generation import SamplingParams, generate

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(paths[0], rmpad=True, dtype=torch.float32)
    model.eval()
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True, eos_token_id=EOS)
    out = []
    for i, path in enumerate(paths):
        if i:
            load_hf_weights(model, path)
        per = []
        for p in prompts:
            g = generate(model, [p], params)
            n = int(g.response_mask[0].sum())
            per.append((g.responses[0, :n].tolist(), g.log_probs[0, :n].tolist()))
        out.append(per)
    return out




def _weights(model) -> dict:
    named = list(model.named_parameters()) + list(model.named_buffers())
    return {k: v.detach().clone() for k, v in named}


def _failing_loader(before: dict, after_tensors: int, seen: dict):
    """A stand-in for the engine's weight loader: it loads ``path`` for real into a new model
    (this rank's shard), copies
    the first ``after_tensors`` of those new tensors into the model (recording how many weights
    then differ from ``before``) and raises a read error."""
    import parallel_models as pm

    def load(model, path):
        staged = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=model.dtype)
        new = dict(staged.named_parameters())
        with torch.no_grad():
            for name, param in list(model.named_parameters())[:after_tensors]:
                param.copy_(new[name])
        now = _weights(model)
        seen["changed_before_error"] = sum(not torch.equal(now[k], v) for k, v in before.items())
        raise OSError("injected read error")

    return load


def atomic_update_http(paths: list[str], prompt: list[int], max_new_tokens: int) -> dict:
    """TP=1, the real app in-process: POST /update_weights fails after some tensors were copied
    -> 400, weights bit-identical, version unchanged, health ok, same greedy tokens; then a
    clean update of the same folder works."""
    from starlette.testclient import TestClient

    import parallel_models as pm
    from parallel_models.inference import engine as engine_module
    from parallel_models.inference.engine import RolloutEngine
    from parallel_models.inference.server.app import ServerLimits, create_app
    from parallel_models.inference.server.engine import Engine

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(paths[0], rmpad=True, dtype=torch.float32)
    engine = Engine(RolloutEngine(model, eos_token_id=EOS, weights_path=paths[0]), tp=1)
    from parallel_models.inference.server.security import ServerSecurity

    asgi, _, _ = create_app(engine, None, ServerLimits(),
                            security=ServerSecurity(enable_admin=True))
    body = {"prompts": [prompt], "greedy": True, "max_new_tokens": max_new_tokens}

    def greedy(client):
        r = client.post("/generate", json=body).json()
        return r["results"][0]["samples"][0]["token_ids"], r["weight_version"]

    res: dict = {}
    with TestClient(asgi, base_url="http://127.0.0.1") as client:
        res["greedy_before"] = greedy(client)
        before = _weights(model)
        real = engine_module.load_weights
        engine_module.load_weights = _failing_loader(before, 3, res)
        try:
            r = client.post("/update_weights", json={"path": paths[1]})
        finally:
            engine_module.load_weights = real
        res["status"], res["error"] = r.status_code, r.json().get("error", "")
        after = _weights(model)
        res["bit_identical"] = before.keys() == after.keys() and all(
            torch.equal(before[k], after[k]) for k in before)
        res["health"] = client.get("/health").json()
        res["greedy_after_failure"] = greedy(client)
        r = client.post("/update_weights", json={"path": paths[1]})
        res["clean_update"] = r.status_code, r.json().get("weight_version")
        res["greedy_new"] = greedy(client)
    return res


def atomic_update_tp(paths: list[str], prompt: list[int], max_new_tokens: int,
                     fail_rank: int) -> dict:
    """TP=2 engines updating together over a group: only ``fail_rank`` fails to load (after
    some tensors) -> every rank keeps its old shard bit-identical, version 0, same greedy."""
    import torch.distributed as dist

    import parallel_models as pm
    from parallel_models.inference import engine as engine_module
    from parallel_models.inference.engine import RolloutEngine, WeightUpdateError
    from parallel_models.inference.sampling import SamplingParams
    from parallel_models.inference.server.engine import make_control_group

    pm.init_parallel(tensor_parallel_size=2)
    group = make_control_group()
    model = pm.AutoModelForCausalLM.from_pretrained(paths[0], rmpad=True, dtype=torch.float32)
    engine = RolloutEngine(model, eos_token_id=EOS, weights_path=paths[0])
    params = SamplingParams(greedy=True, max_new_tokens=max_new_tokens)
    res: dict = {"greedy_before": engine.generate_samples([prompt], params)[0]["token_ids"]}
    before = _weights(model)
    real = engine_module.load_weights
    if dist.get_rank() == fail_rank:
        engine_module.load_weights = _failing_loader(before, 4, res)
    try:
        engine.update_weights(paths[1], group=group)
        res["raised"] = None
    except WeightUpdateError as err:
        res["raised"] = str(err)
    finally:
        engine_module.load_weights = real
    res["bit_identical"] = all(torch.equal(before[k], v) for k, v in _weights(model).items())
    res["version"] = engine.version
    res["greedy_after"] = engine.generate_samples([prompt], params)[0]["token_ids"]
    return res


# ---- issue 30: the server's refusals (tests/inference/test_server_security.py) ---------------

def bad_weight_folders(root, good: str) -> dict:
    """Folders next to ``good`` (a tiny Llama, 2 layers, 4 heads of 16) that must not load into
    it: 3 layers of the same widths, 8 heads of 8 (the same tensor shapes), an extra tensor, and
    an index whose shard path leaves the folder."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    from parallel_models.testing import save_tiny_hf_model
    from parallel_models.tokenizer import build_builtin_tokenizer

    out = {}
    for name, over in (("three_layers", {"num_hidden_layers": 3}),
                       ("eight_heads", {"num_attention_heads": 8, "num_key_value_heads": 4,
                                        "head_dim": 8})):
        out[name] = save_tiny_hf_model(str(root / name), "llama", seed=3, vocab_size=74, **over)
        build_builtin_tokenizer().save_pretrained(out[name])
    extra = str(root / "extra_tensor")
    shutil.copytree(good, extra)
    tensors = load_file(os.path.join(extra, "model.safetensors"))
    tensors["model.layers.7.mlp.up_proj.weight"] = torch.zeros(96, 64)
    save_file(tensors, os.path.join(extra, "model.safetensors"), metadata={"format": "pt"})
    out["extra_tensor"] = extra
    escape = root / "escape"
    escape.mkdir()
    shutil.copy(os.path.join(good, "config.json"), escape / "config.json")
    rel = os.path.relpath(os.path.join(good, "model.safetensors"), escape)
    with open(escape / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: rel for k in tensors
                                                  if "layers.7" not in k}}, f)
    out["escape"] = str(escape)
    return out


def _hanging_listener():
    """A TCP port that accepts connections and never answers (a peer whose join hangs)."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


def security_checks(paths: list[str], bad: dict, prompt: list[int]) -> dict:
    """TP=1, the real app in-process (Starlette's TestClient): every refusal of issue 30's
    server items, and the answers that must still work. Returns what each request got."""
    import time

    from starlette.testclient import TestClient

    import parallel_models as pm
    from parallel_models.inference.engine import RolloutEngine
    from parallel_models.inference.server.app import ServerLimits, create_app
    from parallel_models.inference.server.engine import Engine
    from parallel_models.inference.server.security import ServerSecurity
    from parallel_models.tokenizer import load_tokenizer

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(paths[0], rmpad=True, dtype=torch.float32)
    engine = Engine(RolloutEngine(model, eos_token_id=EOS, weights_path=paths[0]), tp=1)
    tok = load_tokenizer(paths[0])
    limits = ServerLimits(max_new_tokens=8)
    res: dict = {}

    def answer(r):
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    greedy = {"prompts": [prompt], "greedy": True, "max_new_tokens": 6}
    json_type = {"Content-Type": "application/json"}

    # (1) the default: loopback, no key, admin endpoints off
    asgi, _, _ = create_app(engine, tok, limits)
    with TestClient(asgi, base_url="http://127.0.0.1:8000") as c:
        res["default_generate"] = answer(c.post("/generate", json=greedy))
        for path, body in (("/shutdown", None), ("/update_weights", {"path": paths[1]}),
                           ("/weights_group/init", {"master_addr": "127.0.0.1",
                                                    "master_port": 1, "world_size": 2}),
                           ("/weights_group/status", None)):
            method = "GET" if path.endswith("status") else "POST"
            res[f"default_admin {path}"] = answer(c.request(method, path, json=body))
    security = ServerSecurity(enable_admin=True, allowed_origins=("http://app.example",))
    asgi, _, state = create_app(engine, tok, limits, security=security)
    with TestClient(asgi, base_url="http://127.0.0.1:8000", raise_server_exceptions=False) as c:
        raw = b'{"prompts": [[1, 5, 6]], "greedy": true, "max_new_tokens": 2}'
        res["text_plain"] = answer(c.post("/generate", content=raw,
                                          headers={"Content-Type": "text/plain"}))
        res["form_shutdown"] = answer(c.post("/shutdown", content=b"a=b", headers={
            "Content-Type": "application/x-www-form-urlencoded"}))
        res["no_type_body"] = answer(c.post("/update_weights", content=b'{"path": "/"}'))
        res["evil_origin_shutdown"] = answer(c.post("/shutdown", headers={
            "Origin": "http://evil.example"}))
        res["evil_origin_generate"] = answer(c.post("/generate", json=greedy, headers={
            "Origin": "http://evil.example"}))
        res["rebound_host"] = answer(c.post("/generate", json=greedy, headers={
            "Host": "evil.example:8000"}))
        res["same_origin"] = answer(c.post("/generate", json=greedy, headers={
            "Origin": "http://127.0.0.1:8000"}))
        r = c.post("/generate", json=greedy, headers={"Origin": "http://app.example"})
        res["allowed_origin"] = (*answer(r), r.headers.get("access-control-allow-origin"))
        r = c.options("/update_weights", headers={"Origin": "http://app.example",
                                                  "Access-Control-Request-Method": "POST"})
        res["preflight"] = (r.status_code, r.headers.get("access-control-allow-origin"))
        res["v1_text_plain"] = answer(c.post("/v1/completions", content=b'{"model": "m", '
                                             b'"prompt": "hi"}', headers={
                                                 "Content-Type": "text/plain"}))
        # (2) the weights-group join: allowed peers only; off the batcher; timeout_s honoured
        res["far_peer"] = answer(c.post("/weights_group/init", json={
            "master_addr": "10.255.255.1", "master_port": 29500, "world_size": 2}))
        hang = _hanging_listener()
        try:
            t0 = time.monotonic()
            res["join"] = answer(c.post("/weights_group/init", json={
                "master_addr": "127.0.0.1", "master_port": hang.getsockname()[1],
                "world_size": 2, "timeout_s": 3}))
            r = c.post("/generate", json=greedy)
            res["generate_during_join"] = (r.status_code, time.monotonic() - t0)
            status = c.get("/weights_group/status").json()
            while status["joining"] and time.monotonic() - t0 < 60:
                time.sleep(0.1)
                status = c.get("/weights_group/status").json()
            res["join_settled_after"] = time.monotonic() - t0
            res["join_status"] = status
        finally:
            hang.close()
        # (3) + (4) weights folders of another model, extra tensors, shards outside the folder
        for name, folder in bad.items():
            res[f"update {name}"] = answer(c.post("/update_weights", json={"path": folder}))
        res["update good"] = answer(c.post("/update_weights", json={"path": paths[1]}))
        # (5) lone surrogates, deep nesting, internal errors
        for path, body in (
                ("/generate", b'{"prompts": ["a\\ud800b"]}'),
                ("/v1/completions", b'{"model": "m", "prompt": "a\\ud800b"}'),
                ("/v1/chat/completions",
                 b'{"model": "m", "messages": [{"role": "user", "content": "a\\udc00"}]}'),
                ("/generate", b'{"prompts": ' + b"[" * 100000 + b"]" * 100000 + b"}"),
                ("/v1/completions", b"[" * 100000 + b"]" * 100000),
                ("/weights_group/update", b'{"buckets": ' + b"[" * 100000 + b"]" * 100000
                 + b"}")):
            res[f"bad body {path} {body[:30]!r}"] = answer(c.post(path, content=body,
                                                                   headers=json_type))
        real = engine.run_generate

        def broken(*args, **kwargs):
            raise RuntimeError("secret internal detail /etc/passwd")

        engine.run_generate = broken
        try:
            res["internal_error"] = answer(c.post("/generate", json=greedy))
        finally:
            engine.run_generate = real
        # (6) out-of-range sampling values, one rule for empty prompts
        for name, body in (("temperature_inf", b'{"prompts": [[1, 5]], "temperature": Infinity}'),
                           ("temperature_nan", b'{"prompts": [[1, 5]], "temperature": NaN}'),
                           ("temperature_1e30", b'{"prompts": [[1, 5]], "temperature": 1e30}'),
                           ("empty_text", b'{"prompts": [""], "max_new_tokens": 4}'),
                           ("empty_ids", b'{"prompts": [[]], "max_new_tokens": 4}'),
                           ("v1_empty_text", b'{"model": "%s", "prompt": ""}' % paths[0].encode())):
            path = "/v1/completions" if name.startswith("v1") else "/generate"
            res[f"range {name}"] = answer(c.post(path, content=body, headers=json_type))
        for seed in (-1, 1 << 62, 1 << 63, 1 << 64, 1 << 100):
            res[f"seed {seed}"] = answer(c.post("/generate", json={
                "prompts": [prompt], "max_new_tokens": 4, "seed": seed}))
            res[f"v1 seed {seed}"] = answer(c.post("/v1/completions", json={
                "model": paths[0], "prompt": [prompt], "max_tokens": 4, "seed": seed}))
        draws = [c.post("/generate", json={"prompts": [prompt], "max_new_tokens": 6,
                                           "n": 4, "seed": s}).json()
                 for s in (0, 1, (1 << 62) - 1)]
        res["seeded_draws"] = [[x["token_ids"] for x in d["results"][0]["samples"]]
                               for d in draws]
        res["health"] = c.get("/health").json()
    return res
