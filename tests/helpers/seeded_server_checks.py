"""Worker for the server's per-prompt seeds (run on a gloo rank): ``/generate`` with
``prompt_seeds`` through the static and the continuous batcher, against the in-process engine."""

from __future__ import annotations

import torch

PROMPTS = [[5, 17, 33, 8], [40, 2], [9, 9, 71], [40, 2]]  # a prompt twice: seeds tell them apart
SAMPLING = {"n": 2, "max_new_tokens": 6, "temperature": 0.9, "top_p": 0.95, "ignore_eos": True}


def load_model(path: str):
    """(gloo rank) the fp32 RmPad model at ``path`` on a TP=1 layout."""
    import parallel_models as pm

    pm.init_parallel(tensor_parallel_size=1)
    return pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)


def batcher_clients(model):
    """``(name, client)`` of a test server on ``model`` through the static and the continuous
    batcher in turn (each client open while its caller's loop body runs)."""
    from starlette.testclient import TestClient

    from parallel_models.inference import RolloutEngine
    from parallel_models.inference.server.app import ServerLimits, create_app
    from parallel_models.inference.server.continuous_batcher import ContinuousBatcher
    from parallel_models.inference.server.engine import Engine

    for name, rollout, batcher in (
            ("static", RolloutEngine(model), None),
            ("continuous", RolloutEngine(model, kv_budget_tokens=128, keep_kv=True),
             ContinuousBatcher)):
        asgi, _, _ = create_app(Engine(rollout, tp=1), None, ServerLimits(), batcher_cls=batcher)
        with TestClient(asgi, base_url="http://127.0.0.1") as client:
            yield name, client


def server_prompt_seeds(path: str) -> dict:
    from parallel_models.inference import RolloutEngine, SamplingParams, prompt_seed

    model = load_model(path)
    seeds = [prompt_seed(11, 4, i) for i in range(len(PROMPTS))]
    samples = RolloutEngine(model).generate_samples(PROMPTS, SamplingParams(**SAMPLING),
                                                    prompt_seeds=seeds)
    out: dict = {"engine": [s["token_ids"] for s in samples]}
    for name, client in batcher_clients(model):
        def tokens(prompts, prompt_seeds, **extra):
            r = client.post("/generate", json={"prompts": prompts, **SAMPLING, **extra,
                                               "prompt_seeds": prompt_seeds})
            assert r.status_code == 200, r.text
            return [s["token_ids"] for res in r.json()["results"] for s in res["samples"]]

        out[name] = tokens(PROMPTS, seeds)
        # reversed order, and a request seed beside: each prompt's samples stay its own
        rev = tokens(PROMPTS[::-1], seeds[::-1], seed=5)
        out[name + "_reversed"] = [rev[2 * (len(PROMPTS) - 1 - i) + j]
                                   for i in range(len(PROMPTS)) for j in range(2)]
        bad = client.post("/generate", json={"prompts": PROMPTS, **SAMPLING,
                                             "prompt_seeds": seeds[:2]})
        out[name + "_short"] = bad.status_code, bad.text
        bad = client.post("/generate", json={"prompts": PROMPTS[:1], **SAMPLING,
                                             "prompt_seeds": [1 << 62]})
        out[name + "_range"] = bad.status_code, bad.text
    return out
