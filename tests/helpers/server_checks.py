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
    asgi, _, _ = create_app(engine, None, ServerLimits())
    body = {"prompts": [prompt], "greedy": True, "max_new_tokens": max_new_tokens}

    def greedy(client):
        r = client.post("/generate", json=body).json()
        return r["results"][0]["samples"][0]["token_ids"], r["weight_version"]

    res: dict = {}
    with TestClient(asgi) as client:
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
