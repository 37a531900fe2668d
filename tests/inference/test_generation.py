"""Rollout generation: greedy == transformers.generate (fp32, TP=1/2/2+SP), sampled log-probs ==
a fresh forward pass, identical tokens on every TP rank."""

import pytest
import torch

from parallel_models.testing import run_named_jobs
from tests.helpers import generation_checks

SETTINGS = [(1, False), (2, False), (2, True)]


@pytest.fixture(scope="module")
def results(hf_models):
    """One spawned world per TP size runs every family x setting of that size."""
    return run_named_jobs([((fam, tp, sp), tp, (generation_checks.check_generation,
                                                 (hf_models[(fam, "causal_lm")], tp, sp)))
                           for fam in ("llama", "qwen2") for tp, sp in SETTINGS])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tp,sp", SETTINGS)
def test_generation(results, family, tp, sp):
    ranks = results[(family, tp, sp)]
    for r in ranks:
        assert r["greedy_mismatches"] == [], \
            f"greedy differs from transformers for prompts {r['greedy_mismatches']}"
        assert r["logp_err"] <= 1e-4, f"sampling log-probs vs fresh forward: {r['logp_err']:.2e}"
        assert r["stop_ok"]
        assert torch.equal(r["responses"], ranks[0]["responses"]), "TP ranks drew different tokens"


def test_bad_sampling_params():
    from parallel_models.inference.generation import SamplingParams

    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0).validate()
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0).validate()


def test_sampling_params_bounds_and_strict_types():
    from pydantic import ValidationError

    from parallel_models.inference.sampling import SamplingParams

    assert SamplingParams(greedy=True, temperature=0).greedy  # temperature unused when greedy
    for bad, field in [({"n": "2"}, "n"), ({"n": 0}, "n"), ({"top_k": -1}, "top_k"),
                       ({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1},
                       "temperature"), ({"temperature": True}, "temperature"),
                       ({"greedy": 1}, "greedy"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
                       ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
                       ({"pad_token_id": 0}, "pad_token_id")]:
        with pytest.raises(ValidationError, match=field):
            SamplingParams(**bad)
    p = SamplingParams(stop_token_ids=[9, 2], eos_token_id=2)
    assert p.stop_ids() == [2, 9]
    assert p.stop_ids(default_eos=5) == [2, 9]              # its own EOS wins
    assert SamplingParams(stop_token_ids=[9]).stop_ids(default_eos=[5, 6]) == [5, 6, 9]
    assert SamplingParams(stop_token_ids=[9], ignore_eos=True).stop_ids(5) == [9]
    # n and seed do not split a batch; anything that changes the draws does
    assert SamplingParams(n=2, seed=1).sampling_key() == SamplingParams().sampling_key()
    assert SamplingParams(top_p=0.5).sampling_key() != SamplingParams().sampling_key()
    with pytest.raises(ValueError, match="one sample per row"):
        from parallel_models.inference.generation import generate

        generate(None, [[1]], SamplingParams(n=2))


def test_server_request_and_client_share_sampling_params():
    """The server's /generate body is SamplingParams + prompts/return_text: the documented body
    parses unchanged; the client checks its params before sending anything."""
    from pydantic import ValidationError

    from parallel_models.inference.sampling import SamplingParams
    from parallel_models.inference.server.app import GenerateRequest
    from parallel_models.inference.server.client import RolloutClient

    body = {"prompts": ["hi", [1, 2]], "n": 2, "max_new_tokens": 16, "temperature": 1.0,
            "top_k": 0, "top_p": 1.0, "greedy": False, "seed": None, "stop_token_ids": [],
            "ignore_eos": False, "return_text": True}
    req = GenerateRequest.model_validate(body)
    assert isinstance(req, SamplingParams)
    assert req.sampling() == SamplingParams(n=2)
    with pytest.raises(ValidationError, match="bogus"):
        GenerateRequest.model_validate({**body, "bogus": 1})
    client = RolloutClient("http://127.0.0.1:9")  # nothing listens there: never contacted
    with pytest.raises(ValidationError, match="top_p"):
        client.generate([[1]], top_p=2.0)
    client.close()
