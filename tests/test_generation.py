"""Rollout generation: greedy == transformers.generate (fp32, TP=1/2/2+SP), sampled log-probs ==
a fresh forward pass, identical tokens on every TP rank."""

import pytest
import torch

from parallel_models.testing import run_distributed
from tests import generation_checks

SETTINGS = [(1, False), (2, False), (2, True)]


@pytest.fixture(scope="module")
def results(hf_models):
    return {(fam, tp, sp): run_distributed(generation_checks.check_generation, tp,
                                           hf_models[(fam, "causal_lm")], tp, sp)
            for fam in ("llama", "qwen2") for tp, sp in SETTINGS}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tp,sp", SETTINGS)
def test_generation(results, family, tp, sp):
    ranks = results[(family, tp, sp)]
    for r in ranks:
        assert r["greedy_mismatches"] == [], f"greedy differs from transformers for prompts {r['greedy_mismatches']}"
        assert r["logp_err"] <= 1e-4, f"sampling log-probs vs fresh forward: {r['logp_err']:.2e}"
        assert r["stop_ok"]
        assert torch.equal(r["responses"], ranks[0]["responses"]), "TP ranks drew different tokens"


def test_bad_sampling_params():
    from parallel_models.rl.rollout.generation import SamplingParams

    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0).validate()
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0).validate()
