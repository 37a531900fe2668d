"""Continuous batching (parallel_models.inference.continuous), fp32 on gloo ranks at TP=1 and
TP=2: staggered arrivals under a tight KV budget return for every request exactly what it returns
alone and what transformers.generate returns; a request over the budget fails at once; the n
samples of a prompt share one prefill and equal separate prefills; a seeded request draws the same
amid other traffic; identical prompts hit the prompt LRU."""

import pytest

from parallel_models.testing import run_distributed
from tests.helpers import continuous_checks


@pytest.fixture(scope="module")
def results(hf_models):
    path = hf_models[("llama", "causal_lm")]
    return {tp: run_distributed(continuous_checks.check_continuous, tp, path, tp, timeout=300)
            for tp in (1, 2)}


@pytest.mark.parametrize("tp", [1, 2])
def test_staggered_arrivals_equal_alone_and_transformers(results, tp):
    for r in results[tp]:
        assert r["staggered_vs_alone"] == [], "a request's output depended on the traffic"
        assert r["staggered_vs_hf"] == [], "greedy differs from transformers.generate"
        assert r["waited"], "the budget was meant to make requests wait"
        assert not r["over_budget"] and r["pool_used_after"] == 0
        assert r["tokens"] == results[tp][0]["tokens"], "TP ranks drew different tokens"
        assert r["chunked_prefill_equal"], "prefill in packs changed the tokens"


def test_staggered_same_at_tp1_and_tp2(results):
    assert results[1][0]["tokens"] == results[2][0]["tokens"]


@pytest.mark.parametrize("tp", [1, 2])
def test_request_over_kv_budget_fails_at_once(results, tp):
    r = results[tp][0]
    too_long, too_many, too_wide = r["budget_errors"]
    assert too_long and "KV positions" in too_long and "80" in too_long
    assert too_many and "KV budget is 80 tokens" in too_many
    assert too_wide and "n=5" in too_wide
    assert r["queued_after_errors"] == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_n_samples_share_one_prefill(results, tp):
    r = results[tp][0]
    assert r["shared_prefills"] == 1 and r["shared_prefills_total"] == 4
    assert r["shared_equal"] and r["shared_logp_err"] <= 1e-5


@pytest.mark.parametrize("tp", [1, 2])
def test_seeded_request_reproducible_amid_traffic(results, tp):
    r = results[tp][0]
    assert r["seeded_same"] and r["seeded_samples_differ"]
    assert r["seeded_logp_vs_fresh"] <= 1e-4


def test_prompt_lru(results):
    r = results[1][0]
    assert r["lru_prefills"] == 1 and r["lru_hits"] == 1 and r["lru_equal"]
    assert 0 < r["lru_tokens"] <= 24
    assert r["lru_prefilled_after_clear"] == 1


def test_token_pool_first_fit_and_merge():
    from parallel_models.inference.scheduler import TokenPool

    pool = TokenPool(10)
    a, b, c = pool.allocate(3), pool.allocate(3), pool.allocate(3)
    assert (a, b, c) == (0, 3, 6) and pool.allocate(2) is None
    pool.free(b, 3)
    assert pool.allocate(4) is None  # 3 + 1 free, not contiguous
    pool.free(a, 3)
    assert pool.allocate(6) == 0     # freed neighbours merged
    pool.free(0, 6)
    pool.free(c, 3)
    assert pool.used == 0 and pool.allocate(10) == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_rollout_engine_continuous_equals_static(results, tp):
    """RolloutEngine.generate (the trainer's call) with a KV budget: the same GenerationOutput
    as static batches (greedy), seeded calls reproducible."""
    r = results[tp][0]
    assert r["engine_equal"] and r["engine_logp_err"] <= 1e-5
    assert r["engine_tokens_counted"] and r["engine_seeded_same"]
