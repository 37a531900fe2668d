"""The rollout server's per-prompt seeds (``/generate``'s ``prompt_seeds``, issue 30 item 11):
the static and the continuous batcher draw the in-process engine's tokens for the same seeds,
whatever the order of the prompts or the request's own seed; a wrong count or a seed out of
range is refused naming the field."""

import pytest

from parallel_models.testing import run_distributed
from tests.helpers import seeded_server_checks as checks


@pytest.fixture(scope="module")
def result(hf_models):
    return run_distributed(checks.server_prompt_seeds, 1, hf_models[("llama", "causal_lm")],
                           timeout=300)[0]


@pytest.mark.parametrize("batcher", ["static", "continuous"])
def test_server_draws_the_engine_tokens(result, batcher):
    want = result["engine"]
    assert len(want) == 2 * len(checks.PROMPTS)
    assert want[2:4] != want[6:8], "the same prompt with two seeds drew the same samples"
    assert result[batcher] == want
    assert result[batcher + "_reversed"] == want


@pytest.mark.parametrize("batcher", ["static", "continuous"])
def test_bad_prompt_seeds_are_refused(result, batcher):
    status, text = result[batcher + "_short"]
    assert status == 422 and "prompt_seeds" in text and "2 seeds for 4 prompts" in text
    status, text = result[batcher + "_range"]
    assert status == 422 and "prompt_seeds" in text
