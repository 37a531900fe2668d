"""Per-prompt response caps in an async run (``data.max_new_tokens_key``): the producer reads
each prompt's cap from its record as the trainer does and sends them with the step's request
(``/generate``'s ``prompt_max_new_tokens``); the server's static and continuous batchers give
each prompt's samples exactly the in-process engine's capped tokens; a wrong count or a cap over
``max_new_tokens`` is refused naming the field."""

from __future__ import annotations

import types

import pytest

from parallel_models.testing import run_distributed

PROMPTS = [[5, 17, 33, 8], [40, 2], [9, 9, 71], [40, 2]]
CAPS = [1, 6, 3, 2]  # the same prompt twice with two caps
SAMPLING = {"n": 2, "max_new_tokens": 6, "greedy": True, "ignore_eos": True}


def server_caps(path: str) -> dict:
    """(gloo rank) the engine's capped samples, and the server's through both batchers."""
    from parallel_models.inference import RolloutEngine, SamplingParams
    from tests.helpers.seeded_server_checks import batcher_clients, load_model

    model = load_model(path)
    samples = RolloutEngine(model).generate_samples(PROMPTS, SamplingParams(**SAMPLING),
                                                    max_new_tokens=CAPS)
    out: dict = {"engine": [s["token_ids"] for s in samples]}
    for name, client in batcher_clients(model):
        r = client.post("/generate", json={"prompts": PROMPTS, **SAMPLING,
                                           "prompt_max_new_tokens": CAPS})
        assert r.status_code == 200, r.text
        out[name] = [s["token_ids"] for res in r.json()["results"] for s in res["samples"]]
        for bad, key in ((CAPS[:2], "_count"), ([1, 7, 1, 1], "_over")):
            r = client.post("/generate", json={"prompts": PROMPTS, **SAMPLING,
                                               "prompt_max_new_tokens": bad})
            out[name + key] = r.status_code, r.text
    return out


@pytest.fixture(scope="module")
def result(hf_models):
    return run_distributed(server_caps, 1, hf_models[("llama", "causal_lm")], timeout=300)[0]


@pytest.mark.parametrize("batcher", ["static", "continuous"])
def test_server_caps_each_prompt_as_the_engine_does(result, batcher):
    want = result["engine"]
    assert [len(t) for t in want] == [c for c in CAPS for _ in range(2)]
    assert result[batcher] == want
    status, text = result[batcher + "_count"]
    assert status == 422 and "prompt_max_new_tokens: 2 caps for 4 prompts" in text
    status, text = result[batcher + "_over"]
    assert status == 422 and "7 is over max_new_tokens 6" in text


class _Client:
    def __init__(self):
        self.bodies = []

    def generate(self, prompts, params, **kw):
        self.bodies.append(kw)
        return {"weight_version": 3, "results": [
            {"prompt_token_ids": [1], "samples": [{"token_ids": [7] * cap,
                                                   "log_probs": [-1.0] * cap}
                         for _ in range(params.n)]} for cap in kw["prompt_max_new_tokens"]]}


def test_the_producer_sends_each_prompt_its_records_cap(tmp_path):
    """The plan's caps are the trainer's (``prompt_caps`` of the records, this rank's prompts)
    and the step's request carries them."""
    import json

    from parallel_models.inference import SamplingParams
    from parallel_models.rl.async_rollout.producer import StepPlan
    from parallel_models.rl.async_rollout.rollout import AsyncServerRollout
    from parallel_models.rl.data.prompts import PromptDataset, PromptLoader, prompt_caps
    from parallel_models.tokenizer import build_builtin_tokenizer

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"say {i}", "budget": 1 + i % 6}) + "\n"
                            for i in range(8)))
    loader = PromptLoader(PromptDataset(path, build_builtin_tokenizer()), batch_size=4,
                          shuffle=False, seed=0)
    data = types.SimpleNamespace(max_new_tokens_key="budget", path=str(path), task=None)
    plan = StepPlan(loader, 0, dp_rank=1, dp_size=2, seed=0, greedy=True,
                    caps=lambda records, rows: prompt_caps(records, rows, data, 6))
    assert [plan.next().prompt_caps, plan.next().prompt_caps] == [[2, 4], [6, 2]]

    rollout = AsyncServerRollout.__new__(AsyncServerRollout)
    rollout.client = _Client()
    rollout.sampling = SamplingParams(greedy=True, n=2, max_new_tokens=6)
    rollout.inner = types.SimpleNamespace(eos_token_id=2, num_experts=None, pad_token_id=0)
    batch, versions = rollout._request(plan.at(1))
    assert rollout.client.bodies[0]["prompt_max_new_tokens"] == [6, 2]
    assert batch["response_mask"].sum(-1).tolist() == [6, 6, 2, 2]
    assert versions == [[3] * 6, [3] * 6, [3] * 2, [3] * 2]


def test_async_runs_take_response_caps_on_either_backend():
    from parallel_models.errors import ConfigError
    from parallel_models.rl.config import load_config

    server = ["rollout.backend=server", "rollout.server_url=http://127.0.0.1:1",
              "data.max_new_tokens_key=budget"]
    load_config(None, ["trainer.mode=async", *server]).validate()
    load_config(None, ["trainer.mode=async", "data.max_new_tokens_key=budget"]).validate()
    with pytest.raises(ConfigError, match="max_new_tokens_key"):  # sync: the in-process rollout
        load_config(None, server).validate()
