"""Every advantage estimator, policy loss and loss aggregation that verl 0.9.1's ``core_algos.py``
also has, against verl's own code (verbatim copies in tests/helpers/verl_core_algos.py) on random
inputs, float64 and float32: masks with holes and all-empty rows, groups of one, all-equal
rewards. Where our convention differs on purpose the test says how and checks that difference:

* groups of one: our group estimators give advantage 0 (no baseline to compare with); verl
  takes a baseline of 0 there (the advantage is the raw score). Ours on a batch equals verl's on
  the same batch with the singletons' rewards set to 0.
* remax: we zero masked positions; verl's reward-to-go is not masked at holes inside a response.
* geo_mean: we aggregate by ``loss_agg_mode`` (``seq-mean-token-mean`` = verl's mean over rows)
  and leave all-padding rows out of the mean, verl counts them with loss 0.
* token-mean etc.: verl divides by ``count + 1e-8``, we by ``max(count, 1)`` (the tolerances).
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from parallel_models.rl.algorithms import core as algos
from parallel_models.rl.algorithms import estimators, losses
from tests.helpers import verl_core_algos as verl

TOL = {torch.float64: dict(rtol=1e-6, atol=1e-8), torch.float32: dict(rtol=2e-5, atol=2e-6)}
DTYPES = (torch.float64, torch.float32)
MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
         "seq-mean-token-sum-norm")


def _mask(lengths, width, holes=False, seed=0):
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).double()
    if holes:  # tool-output tokens inside responses (never the first token)
        g = torch.Generator().manual_seed(seed)
        holes = (torch.rand(mask.shape, generator=g) < 0.2) & (torch.arange(width) > 0)
        mask = mask * (~holes).double()
    return mask


def _group_batch(dtype, sizes, seed=0, equal=False, holes=False, width=9):
    """Token-level rewards (a score on the last valid token plus a small per-token term, zero at
    masked positions), mask, group labels; groups of ``sizes``; row 1 is all padding."""
    g = torch.Generator().manual_seed(seed)
    index = np.array([gi for gi, n in enumerate(sizes) for _ in range(n)])
    rng = np.random.default_rng(seed)
    rng.shuffle(index)  # groups need not be contiguous
    b = len(index)
    lengths = torch.randint(1, width + 1, (b,), generator=g)
    lengths[1] = 0
    mask = _mask(lengths.tolist(), width, holes, seed).to(dtype)
    scores = torch.ones(b, dtype=dtype) if equal else torch.randn(b, generator=g, dtype=dtype)
    rewards = algos.scores_at_last_token(scores, mask).to(dtype)
    if not equal:
        rewards = rewards + 0.1 * torch.randn(rewards.shape, generator=g, dtype=dtype) * mask
    return rewards, mask, index


def _ours(name, rewards, mask, index, baselines=None, **alg):
    cfg = SimpleNamespace(adv_estimator=name, gamma=alg.pop("gamma", 1.0), lam=1.0,
                          whiten_advantages=None, norm_adv_by_std=alg.pop("norm", True))
    adv, ret = estimators.run_estimator(cfg, rewards, mask, None, torch.as_tensor(index),
                                        reward_baselines=baselines)
    if estimators.declares(cfg, "whiten_by_default"):
        adv = algos.masked_whiten(adv, mask)
    return adv, ret


def _singletons_zeroed(rewards, index):
    labels, counts = np.unique(index, return_counts=True)
    single = torch.as_tensor(np.isin(index, labels[counts == 1]))
    return torch.where(single[:, None], torch.zeros_like(rewards), rewards), single


def _verl_estimator(name, rewards, mask, index, norm=True):
    if name == "grpo":
        return verl.compute_grpo_outcome_advantage(rewards.clone(), mask, index,
                                                   norm_adv_by_std_in_grpo=norm)
    fn = {"rloo": verl.compute_rloo_outcome_advantage,
          "opo": verl.compute_opo_outcome_advantage,
          "gpg": verl.compute_gpg_outcome_advantage,
          "reinforce_plus_plus_baseline":
              verl.compute_reinforce_plus_plus_baseline_outcome_advantage}[name]
    return fn(rewards.clone(), mask, index)


GROUP_ESTIMATORS = [("grpo", True), ("grpo", False), ("rloo", True), ("opo", True),
                    ("gpg", True), ("reinforce_plus_plus_baseline", True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,norm", GROUP_ESTIMATORS)
@pytest.mark.parametrize("equal", [False, True])
def test_group_estimators_equal_verl(name, norm, dtype, equal):
    rewards, mask, index = _group_batch(dtype, [4, 3, 5, 2], seed=3, equal=equal, holes=True)
    adv, ret = _ours(name, rewards, mask, index, norm=norm)
    v_adv, v_ret = _verl_estimator(name, rewards, mask, index, norm=norm)
    torch.testing.assert_close(adv, v_adv.to(dtype), **TOL[dtype])
    if not estimators.declares(SimpleNamespace(adv_estimator=name), "whiten_by_default"):
        torch.testing.assert_close(ret, v_ret.to(dtype), **TOL[dtype])
    if equal and name != "reinforce_plus_plus_baseline":  # no signal where a group agrees
        seq = rewards.sum(-1)
        agree = torch.tensor([bool((seq[index == gi] == seq[i]).all()) for i, gi in
                              enumerate(index)])
        assert agree.sum() >= 8 and adv[agree].abs().max() < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,norm", GROUP_ESTIMATORS)
def test_groups_of_one_get_zero_where_verl_uses_the_raw_score(name, norm, dtype):
    rewards, mask, index = _group_batch(dtype, [3, 1, 4, 1, 2], seed=5)
    adv, _ = _ours(name, rewards, mask, index, norm=norm)
    zeroed, single = _singletons_zeroed(rewards, index)
    if name != "reinforce_plus_plus_baseline":  # (that one whitens the zeros afterwards)
        assert torch.all(adv[single] == 0)
    if name == "gpg":  # alpha counts the singletons' nonzero scores: compare the others
        v_adv, _ = _verl_estimator(name, rewards, mask, index)
        torch.testing.assert_close(adv[~single], v_adv[~single].to(dtype), **TOL[dtype])
        return
    v_adv, _ = _verl_estimator(name, zeroed, mask, index, norm=norm)
    torch.testing.assert_close(adv, v_adv.to(dtype), **TOL[dtype])
    raw, _ = _verl_estimator(name, rewards, mask, index, norm=norm)  # verl: not zero there
    assert raw[single].abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_plus_plus_equals_verl(dtype, holes):
    rewards, mask, index = _group_batch(dtype, [12], seed=7, holes=holes)
    adv, ret = _ours("reinforce_plus_plus", rewards, mask, index, gamma=0.9)
    v_adv, v_ret = verl.compute_reinforce_plus_plus_outcome_advantage(
        rewards.clone(), mask, config=verl.AlgoConfig(gamma=0.9))
    torch.testing.assert_close(adv, v_adv.to(dtype), **TOL[dtype])
    torch.testing.assert_close(ret, v_ret.to(dtype), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("holes", [False, True])
def test_remax_equals_verl(dtype, holes):
    rewards, mask, index = _group_batch(dtype, [10], seed=11, holes=holes)
    baselines = torch.randn(len(index), generator=torch.Generator().manual_seed(1), dtype=dtype)
    adv, ret = _ours("remax", rewards, mask, index, baselines=baselines)
    v_adv, v_ret = verl.compute_remax_outcome_advantage(rewards.clone(), baselines, mask)
    valid = mask > 0  # verl leaves the reward-to-go at holes unmasked; ours is 0 there
    torch.testing.assert_close(adv[valid], v_adv[valid].to(dtype), **TOL[dtype])
    torch.testing.assert_close(ret[valid], v_ret[valid].to(dtype), **TOL[dtype])
    assert torch.all(adv[~valid] == 0) and torch.all(ret[~valid] == 0)
    if not holes:
        torch.testing.assert_close(adv, v_adv.to(dtype), **TOL[dtype])


def test_remax_without_baselines_is_a_clear_error():
    rewards, mask, index = _group_batch(torch.float64, [4], seed=1)
    with pytest.raises(ValueError, match="reward_baselines"):
        estimators.remax(token_level_rewards=rewards, response_mask=mask, values=None,
                         group_index=torch.as_tensor(index), config=None)


# ---- aggregation and policy losses ------------------------------------------------------------

def _loss_inputs(dtype, seed=0, b=8, width=10, seq_adv=False, empty=True):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (b,), generator=g)
    if empty:
        lengths[2] = 0
    mask = _mask(lengths.tolist(), width, holes=True, seed=seed).to(dtype)
    logp = -torch.rand(b, width, generator=g, dtype=dtype) * 3
    old = logp + 0.3 * torch.randn(b, width, generator=g, dtype=dtype)
    adv = 2 * torch.randn(b, 1 if seq_adv else width, generator=g, dtype=dtype).expand(b, width)
    return logp, old, adv.contiguous(), mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale", [None, 5])
def test_agg_loss_equals_verl(mode, dtype, scale):
    loss_mat, _, _, mask = _loss_inputs(dtype, seed=2)
    kw = {} if scale is None else {"loss_scale_factor": scale}
    ours = losses.agg_loss(loss_mat, mask, mode, **kw)
    torch.testing.assert_close(ours, verl.agg_loss(loss_mat, mask, mode, **kw), **TOL[dtype])
    empty = torch.zeros_like(mask)
    assert losses.agg_loss(loss_mat, empty, mode) == 0


def _configs(mode, lo=0.2, hi=0.28, scale=None, **loss_knobs):
    knobs = dict(clip_cov_ratio=0.2, clip_cov_lb=0.0, clip_cov_ub=5.0, kl_cov_ratio=0.2,
                 ppo_kl_coef=0.7)
    knobs.update(loss_knobs)
    ours = SimpleNamespace(clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=3.0,
                           loss_agg_mode=mode, loss_scale_factor=scale, **knobs)
    theirs = verl.ActorConfig(clip_ratio=0.2, clip_ratio_low=lo, clip_ratio_high=hi,
                              clip_ratio_c=3.0, policy_loss=SimpleNamespace(**knobs),
                              global_batch_info={} if scale is None else
                              {"loss_scale_factor": scale})
    return ours, theirs


VERL_LOSSES = {"vanilla": verl.compute_policy_loss_vanilla, "ppo": verl.compute_policy_loss_vanilla,
               "gspo": verl.compute_policy_loss_gspo, "gpg": verl.compute_policy_loss_gpg,
               "clip_cov": verl.compute_policy_loss_clip_cov,
               "kl_cov": verl.compute_policy_loss_kl_cov, "cispo": verl.compute_policy_loss_cispo,
               "geo_mean": verl.compute_policy_loss_geo_mean}
# verl logs kl_cov's mean |log ratio| as ppo_kl; ours names it ppo_kl_abs
RENAMED = {"ppo_kl_abs": "ppo_kl"}


def _run_both(name, mode, dtype, weights=False, seq_adv=False, empty=True, scale=None, seed=4):
    logp, old, adv, mask = _loss_inputs(dtype, seed=seed, seq_adv=seq_adv, empty=empty)
    w = torch.rand(logp.shape, generator=torch.Generator().manual_seed(9), dtype=dtype) + 0.5 \
        if weights else None
    ours_cfg, verl_cfg = _configs(mode, scale=scale)
    lp1, lp2 = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    torch.manual_seed(0)  # clip_cov draws its tokens from the global generator, as verl does
    loss, metrics = losses.POLICY_LOSSES.get(name)(
        log_probs=lp1, old_log_probs=old, advantages=adv, response_mask=mask, config=ours_cfg,
        token_weights=w)
    torch.manual_seed(0)
    v_loss, v_metrics = VERL_LOSSES[name](old, lp2, adv, mask, mode, verl_cfg, w)
    loss.backward()
    v_loss.backward()
    return (loss, metrics, lp1.grad), (v_loss, v_metrics, lp2.grad), mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["vanilla", "ppo", "gspo", "gpg", "clip_cov", "kl_cov", "cispo"])
@pytest.mark.parametrize("mode", MODES)
def test_policy_losses_equal_verl(name, mode, dtype):
    (loss, metrics, grad), (v_loss, v_metrics, v_grad), mask = _run_both(name, mode, dtype)
    torch.testing.assert_close(loss, v_loss.to(dtype), **TOL[dtype])
    valid = mask > 0
    torch.testing.assert_close(grad[valid], v_grad[valid].to(dtype), **TOL[dtype])
    assert torch.all(grad[~valid] == 0)
    assert set(metrics) == set(losses.POLICY_LOSSES.attribute(losses.POLICY_LOSSES.get(name),
                                                              "metrics"))
    for key, value in metrics.items():
        assert value.requires_grad is False
        assert float(value) == pytest.approx(v_metrics["actor/" + RENAMED.get(key, key)],
                                             rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "cispo"])
def test_policy_losses_equal_verl_with_weights_and_scale(name):
    dtype = torch.float64
    (loss, _, grad), (v_loss, _, v_grad), mask = _run_both(
        name, "seq-mean-token-sum-norm", dtype, weights=True, scale=16)
    torch.testing.assert_close(loss, v_loss, **TOL[dtype])
    torch.testing.assert_close(grad[mask > 0], v_grad[mask > 0], **TOL[dtype])


def test_clip_cov_and_kl_cov_actually_select_tokens():
    """The knobs of the comparisons above make both losses differ from their plain base."""
    dtype = torch.float64
    for name, base in (("clip_cov", "vanilla"), ("kl_cov", "gpg")):
        (loss, metrics, _), _, _ = _run_both(name, "token-mean", dtype)
        if name == "clip_cov":
            assert float(metrics["pg_clipfrac"]) > 0.05
        else:
            logp, old, adv, mask = _loss_inputs(dtype, seed=4)
            plain = algos.masked_mean(-adv * torch.exp(logp - old), mask)
            assert abs(float(loss) - float(plain)) > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", [False, True])
def test_geo_mean_equals_verl_with_seq_mean_token_mean(dtype, weights):
    (loss, metrics, grad), (v_loss, v_metrics, v_grad), mask = _run_both(
        "geo_mean", "seq-mean-token-mean", dtype, weights=weights, seq_adv=True, empty=False)
    torch.testing.assert_close(loss, v_loss.to(dtype), **TOL[dtype])
    torch.testing.assert_close(grad[mask > 0], v_grad[mask > 0].to(dtype), **TOL[dtype])
    for key, value in metrics.items():
        assert float(value) == pytest.approx(v_metrics["actor/" + key], rel=1e-5, abs=1e-6)


def test_geo_mean_leaves_empty_rows_out_where_verl_counts_them():
    (loss, _, _), (v_loss, _, _), mask = _run_both("geo_mean", "seq-mean-token-mean",
                                                   torch.float64, seq_adv=True, empty=True)
    rows, nonempty = mask.shape[0], int((mask.sum(-1) > 0).sum())
    assert nonempty < rows
    torch.testing.assert_close(loss, v_loss * rows / nonempty, **TOL[torch.float64])


def test_masked_padding_garbage_reaches_no_loss_and_no_gradient():
    """-inf / NaN at masked positions (padding) stay out of every policy loss."""
    logp, old, adv, mask = _loss_inputs(torch.float64, seed=6)
    pad = mask == 0
    logp_bad = torch.where(pad, torch.full_like(logp, float("-inf")), logp)
    old_bad = torch.where(pad, torch.full_like(old, float("nan")), old)
    for name in VERL_LOSSES:
        cfg, _ = _configs("token-mean")
        lp = logp_bad.clone().requires_grad_()
        torch.manual_seed(0)
        loss, _ = losses.POLICY_LOSSES.get(name)(log_probs=lp, old_log_probs=old_bad,
                                                 advantages=adv, response_mask=mask, config=cfg,
                                                 token_weights=None)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all(), name
        assert torch.all(lp.grad[pad] == 0), name
