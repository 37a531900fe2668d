"""The advantage phase (rl/algorithms/advantages.py): ``algorithm.whiten_advantages`` means the same for
every estimator, and every batch statistic is global over data-parallel ranks (DP=2 == DP=1 on
the same global batch, including one PPO update's loss and grad norm)."""

from types import SimpleNamespace

import pytest
import torch

from parallel_models.rl.algorithms import core as algos
from parallel_models.rl.algorithms.advantages import compute_advantages
from parallel_models.rl.algorithms.core import FixedKLController
from parallel_models.testing import run_distributed
from tests.helpers import ppo_checks


def _alg(estimator, whiten, kl_in_reward=False):
    return SimpleNamespace(adv_estimator=estimator, whiten_advantages=whiten,
                           kl_in_reward=kl_in_reward, kl_penalty="k1", gamma=0.99, lam=0.9)


def _batch():
    return ppo_checks._global_batch(vocab=64)


def test_whitening_off_with_gae_gives_the_raw_gae():
    raw, on = _batch(), _batch()
    compute_advantages(raw, _alg("gae", False), FixedKLController(0.0))
    compute_advantages(on, _alg("gae", True), FixedKLController(0.0))
    m = raw.response_mask > 0
    zero = torch.zeros(())
    torch.testing.assert_close(raw.advantages, torch.where(m, raw.returns - raw.values, zero))
    torch.testing.assert_close(on.returns, raw.returns)  # the critic's target does not change
    torch.testing.assert_close(on.advantages, algos.masked_whiten(raw.advantages, m))
    assert not torch.allclose(on.advantages, raw.advantages, atol=1e-3)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_whitening_off_with_group_estimators(estimator):
    """Off: the estimator's own advantages (grpo keeps its per-group std normalization); on:
    those, whitened over the batch. Before, ``false`` raised KeyError('values') here."""
    off, on = _batch(), _batch()
    off.values = on.values = None  # no critic
    compute_advantages(off, _alg(estimator, False), FixedKLController(0.0))
    compute_advantages(on, _alg(estimator, True), FixedKLController(0.0))
    seq = algos.masked_sum(algos.scores_at_last_token(off.scores, off.response_mask),
                           off.response_mask, dim=-1)
    fn = algos.compute_grpo_advantages if estimator == "grpo" else algos.compute_rloo_advantages
    want = fn(seq, off.group_index, off.response_mask)
    torch.testing.assert_close(off.advantages, want)
    torch.testing.assert_close(off.returns, want)
    torch.testing.assert_close(on.advantages, algos.masked_whiten(want, off.response_mask))
    assert not torch.allclose(on.advantages, off.advantages, atol=1e-3)


@pytest.mark.parametrize("estimator,whitened", [("gae", True), ("grpo", False), ("rloo", False)])
def test_unset_whitening_follows_the_estimator(estimator, whitened):
    """whiten_advantages=null (the default): gae whitens, grpo / rloo do not (verl's defaults)."""
    unset, explicit = _batch(), _batch()
    if estimator != "gae":
        unset.values = explicit.values = None
    compute_advantages(unset, _alg(estimator, None), FixedKLController(0.0))
    compute_advantages(explicit, _alg(estimator, whitened), FixedKLController(0.0))
    torch.testing.assert_close(unset.advantages, explicit.advantages, rtol=0, atol=0)


def test_kl_in_reward_current_kl_is_verls_convention():
    b = _batch()
    b.old_log_probs = b.ref_log_probs + 0.3
    metrics = compute_advantages(b, _alg("gae", True, kl_in_reward=True), FixedKLController(0.1))
    assert metrics["kl/current_kl"] == pytest.approx(0.3, abs=1e-6)
    assert metrics["kl/token_kl"] == metrics["kl/current_kl"]
    placed = algos.scores_at_last_token(b.scores, b.response_mask)
    torch.testing.assert_close(b.token_level_rewards,
                               torch.where(b.response_mask > 0, placed - 0.1 * 0.3,
                                           torch.zeros(())))


def test_data_parallel_2_equals_1_on_the_same_global_batch(hf_models):
    path = hf_models[("llama", "causal_lm")]
    modes = ["token-mean", "seq-mean-token-mean"]
    one = run_distributed(ppo_checks.dp_advantages_and_update, 1, path, modes)[0]
    two = run_distributed(ppo_checks.dp_advantages_and_update, 2, path, modes)
    assert sorted(two[0]["rows"] + two[1]["rows"]) == one["rows"] == list(range(8))
    assert set(two[0]["rows"]) == {0, 1, 4, 5}  # prompts 0 and 2: groups stay on one rank
    for est in ("gae", "grpo"):
        for res in two:
            for key in ("advantages", "returns"):
                torch.testing.assert_close(res[est][key], one[est][key][res["rows"]],
                                           rtol=1e-6, atol=1e-6, msg=f"{est} {key}")
            assert res[est]["current_kl"] == pytest.approx(one[est]["current_kl"], abs=1e-7)
    for res in two:  # the metric reductions (max, min, row mean, token mean) are global too
        for key, value in one["stats"].items():
            assert res["stats"][key] == pytest.approx(value, abs=1e-6), key  # fp32 sums
    assert one["stats"]["max"] > one["stats"]["mean"] > one["stats"]["min"]
    for mode in modes:
        want = one["update"][mode]
        assert want["actor/grad_norm"] > 0
        for res in two:
            got = res["update"][mode]
            for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac",
                        "actor/grad_norm"):
                # fp32; the ranks pack other microbatches, so logits differ in the last bits
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), \
                    (mode, key, got[key], want[key])
