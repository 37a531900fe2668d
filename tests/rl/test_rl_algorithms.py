"""parallel_models.rl.algorithms.core (masked reductions, GAE and returns, GRPO / RLOO advantages,
KL penalties and controllers) against the plain Python-loop references of
tests/helpers/rl_loop_references.py."""

import math

import pytest
import torch

from parallel_models.rl.algorithms.core import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_gae,
    compute_grpo_advantages,
    compute_returns,
    compute_rloo_advantages,
    kl_penalty,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    scores_at_last_token,
)
from tests.helpers.rl_loop_references import (
    B,
    T,
    TOL,
    make_mask,
    randn,
    ref_gae,
    ref_group_adv,
    ref_kl,
    ref_masked_mean_all,
    ref_masked_var_all,
    ref_returns,
    ref_whiten,
    rows,
)


# ---------------------------------------------------------------------------
# Masked reductions
# ---------------------------------------------------------------------------


def test_masked_mean_sum_var_match_loops():
    mask = make_mask(1)
    x = randn(2, B, T)
    # Garbage in padding must not leak into any statistic.
    x = torch.where(mask.bool(), x, torch.tensor(float("nan"), dtype=torch.float64))
    expected_mean = torch.tensor(ref_masked_mean_all(x, mask), dtype=torch.float64)
    torch.testing.assert_close(masked_mean(x, mask), expected_mean, **TOL)
    total = sum(xv for xr, mr in zip(rows(x), rows(mask)) for xv, mv in zip(xr, mr) if mv)
    torch.testing.assert_close(masked_sum(x, mask), torch.tensor(total, dtype=torch.float64), **TOL)
    for unbiased in (True, False):
        torch.testing.assert_close(
            masked_var(x, mask, unbiased=unbiased),
            torch.tensor(ref_masked_var_all(x, mask, unbiased), dtype=torch.float64),
            **TOL,
        )
    # Per-row (dim=-1), including the all-zero row, which must be 0, not NaN.
    row_means = masked_mean(x, mask.bool(), dim=-1)
    row_vars = masked_var(x, mask, dim=-1)
    for b in range(B):
        assert row_means[b].item() == pytest.approx(ref_masked_mean_all(x[b:b + 1], mask[b:b + 1]), abs=1e-9)
        assert row_vars[b].item() == pytest.approx(ref_masked_var_all(x[b:b + 1], mask[b:b + 1]), abs=1e-9)
    assert row_means[B // 2].item() == 0.0 and row_vars[B // 2].item() == 0.0
    # Agreement with torch.var on the compacted values.
    torch.testing.assert_close(masked_var(x, mask), x[mask.bool()].var(), **TOL)


def test_masked_reductions_all_zero_mask():
    x = randn(3, 4, 5)
    zero = torch.zeros(4, 5)
    for v in (masked_mean(x, zero), masked_var(x, zero), masked_var(x, zero, unbiased=False), masked_sum(x, zero)):
        assert v.item() == 0.0
    w = masked_whiten(x, zero)
    assert torch.isfinite(w).all() and (w == 0).all()
    # Single valid element: unbiased variance is undefined -> 0, whitened value -> 0.
    one = torch.zeros(4, 5)
    one[1, 2] = 1
    assert masked_var(x, one).item() == 0.0
    assert masked_var(x, one, unbiased=False).item() == 0.0
    assert (masked_whiten(x, one) == 0).all()


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_loop(shift_mean):
    mask = make_mask(4)
    x = randn(5, B, T) * 3 + 1.5
    out = masked_whiten(x, mask, shift_mean=shift_mean)
    torch.testing.assert_close(out, ref_whiten(x, mask, shift_mean), **TOL)
    if shift_mean:
        assert abs(masked_mean(out, mask).item()) < 1e-9
        assert masked_var(out, mask).item() == pytest.approx(1.0, abs=1e-6)


# ---------------------------------------------------------------------------
# GAE / returns
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_compute_gae_matches_loop(gamma, lam):
    mask = make_mask(6)
    rewards = randn(7, B, T)
    values = randn(8, B, T)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = ref_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(ret, ref_ret, **TOL)
    torch.testing.assert_close(adv, ref_adv, **TOL)
    # The bool mask gives the same answer as the float mask.
    adv_b, ret_b = compute_gae(rewards, values, mask.bool(), gamma, lam)
    torch.testing.assert_close(adv_b, adv, **TOL)
    torch.testing.assert_close(ret_b, ret, **TOL)


def test_compute_gae_holes_equal_compacted_sequence():
    """A row with holes gets exactly the GAE of the row with the holes cut out."""
    gamma, lam = 0.97, 0.9
    mask = make_mask(9, empty_row=False)
    rewards = randn(10, B, T)
    values = randn(11, B, T)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    for b in range(B):
        idx = mask[b].nonzero().flatten()
        r_c, v_c = rewards[b, idx][None], values[b, idx][None]
        _, ret_c = compute_gae(r_c, v_c, torch.ones_like(r_c), gamma, lam)
        torch.testing.assert_close(ret[b, idx], ret_c[0], **TOL)
        # Holes are zeroed, and changing rewards/values at holes changes nothing.
        assert (ret[b][mask[b] == 0] == 0).all()
    noisy_r = torch.where(mask.bool(), rewards, rewards + 100)
    noisy_v = torch.where(mask.bool(), values, values - 50)
    adv2, ret2 = compute_gae(noisy_r, noisy_v, mask, gamma, lam)
    torch.testing.assert_close(ret2, ret, **TOL)
    torch.testing.assert_close(adv2, adv, **TOL)


def test_compute_gae_single_step_hand_value():
    # One valid token, then a hole, then another valid token: hand-computed.
    r = torch.tensor([[1.0, 5.0, 2.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 9.0, 0.25]], dtype=torch.float64)
    m = torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64)
    gamma, lam = 0.5, 0.5
    _, ret = compute_gae(r, v, m, gamma, lam)
    a2 = 2.0 - 0.25
    a0 = (1.0 + gamma * 0.25 - 0.5) + gamma * lam * a2
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, 0.0, a2 + 0.25]], dtype=torch.float64), **TOL)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_compute_returns_matches_loop_and_gae(gamma):
    mask = make_mask(12)
    rewards = randn(13, B, T)
    out = compute_returns(rewards, mask, gamma)
    torch.testing.assert_close(out, ref_returns(rewards, mask, gamma), **TOL)
    _, gae_ret = compute_gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    torch.testing.assert_close(out, gae_ret, **TOL)


# ---------------------------------------------------------------------------
# GRPO / RLOO
# ---------------------------------------------------------------------------


def _groups():
    # Non-contiguous, unsorted ids; group 42 has a single member.
    return torch.tensor([3, 7, 3, 42, 7, 3, 7, 11, 11])


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_loop(norm_by_std):
    groups = _groups()
    n = groups.numel()
    mask = make_mask(14, batch=n)
    scores = randn(15, n)
    adv = compute_grpo_advantages(scores, groups, mask, norm_by_std=norm_by_std)
    torch.testing.assert_close(adv, ref_group_adv(scores, groups, mask, "grpo", norm_by_std), **TOL)
    # Group of one -> zero advantage everywhere on its row.
    assert (adv[3] == 0).all()
    # Same answer when the groups are given as string uids.
    adv_s = compute_grpo_advantages(scores, [f"uid{g}" for g in groups.tolist()], mask, norm_by_std=norm_by_std)
    torch.testing.assert_close(adv_s, adv, **TOL)
    if norm_by_std:
        sel = groups == 3
        expected = (scores[sel] - scores[sel].mean()) / (scores[sel].std() + 1e-6)
        got = torch.stack([adv[i][mask[i].bool()][0] for i in sel.nonzero().flatten().tolist() if mask[i].any()])
        exp_kept = torch.stack([expected[k] for k, i in enumerate(sel.nonzero().flatten().tolist()) if mask[i].any()])
        torch.testing.assert_close(got, exp_kept, **TOL)


def test_grpo_constant_group_is_zero():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1])
    mask = torch.ones(5, 3, dtype=torch.float64)
    adv = compute_grpo_advantages(scores, groups, mask)
    assert torch.isfinite(adv).all()
    assert (adv[:3] == 0).all()
    assert adv[3, 0].item() < 0 < adv[4, 0].item()


def test_rloo_matches_loop():
    groups = _groups()
    n = groups.numel()
    mask = make_mask(16, batch=n)
    scores = randn(17, n)
    adv = compute_rloo_advantages(scores, groups, mask)
    torch.testing.assert_close(adv, ref_group_adv(scores, groups, mask, "rloo"), **TOL)
    assert (adv[3] == 0).all()
    with pytest.raises(ValueError):
        compute_rloo_advantages(scores[None], groups, mask)


# ---------------------------------------------------------------------------
# KL
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_kl_penalty_matches_loop(kind):
    lp = randn(18, B, T) * 2
    ref = randn(19, B, T) * 2
    # Include far-apart pairs so the k3 clamp is exercised in both directions.
    lp[0, 0], ref[0, 0] = -30.0, 0.0
    lp[0, 1], ref[0, 1] = 0.0, -30.0
    out = kl_penalty(lp, ref, kind)
    expected = torch.tensor(
        [[ref_kl(a, b, kind) for a, b in zip(ra, rb)] for ra, rb in zip(rows(lp), rows(ref))], dtype=torch.float64
    )
    torch.testing.assert_close(out, expected, **TOL)


def test_kl_k3_extreme_values_finite_gradient():
    lp = torch.tensor([-1000.0, 0.0, -0.3], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([0.0, -1000.0, -0.1], dtype=torch.float64)
    out = kl_penalty(lp, ref, "k3")
    assert out[0].item() == 10.0 and out[1].item() == 10.0
    out.sum().backward()
    assert torch.isfinite(lp.grad).all()
    # Unclamped element: d/dlp [exp(ref-lp) - (ref-lp) - 1] = 1 - exp(ref-lp).
    assert lp.grad[2].item() == pytest.approx(1 - math.exp(-0.1 + 0.3), abs=1e-12)


def test_kl_penalty_unknown_kind():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 256)
    assert fixed.value == 0.05

    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    expected = 0.2
    for current, n in [(3.0, 64), (6.0, 64), (6.6, 128), (100.0, 256), (0.0, 512), (torch.tensor(7.0), 32)]:
        ctrl.update(current, n)
        err = min(max(float(current) / 6.0 - 1, -0.2), 0.2)
        expected *= 1 + err * n / 10000
        assert ctrl.value == pytest.approx(expected, rel=1e-12)
    # The clip must bind: a huge KL moves the coefficient by exactly +20% * n / horizon.
    ctrl2 = AdaptiveKLController(1.0, 1.0, 100)
    ctrl2.update(1e6, 10)
    assert ctrl2.value == pytest.approx(1.02, rel=1e-12)


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_apply_kl_penalty_matches_loop(kind):
    mask = make_mask(20)
    scores = randn(21, B, T)
    lp, ref = randn(22, B, T), randn(23, B, T)
    ctrl = AdaptiveKLController(0.1, target_kl=1.0, horizon=1000)
    rewards, metrics = apply_kl_penalty(scores, lp, ref, mask, ctrl, kind)

    S, LP, RF, M = rows(scores), rows(lp), rows(ref), rows(mask)
    exp_r, seq_kls, row_means = [], [], []
    for b in range(B):
        row, seq, n = [], 0.0, 0
        for t in range(T):
            if M[b][t]:
                k = ref_kl(LP[b][t], RF[b][t], kind)
                row.append(S[b][t] - 0.1 * k)
                seq += k
                n += 1
            else:
                row.append(0.0)
        exp_r.append(row)
        row_means.append(seq / n if n else 0.0)  # verl: an empty row counts as 0
        if any(M[b]):
            seq_kls.append(seq)
    torch.testing.assert_close(rewards, torch.tensor(exp_r, dtype=torch.float64), **TOL)
    current = sum(row_means) / B
    assert metrics["current_kl"] == pytest.approx(current, abs=1e-9)
    assert metrics["token_kl"] == pytest.approx(current, abs=1e-9)
    assert metrics["seq_kl"] == pytest.approx(sum(seq_kls) / len(seq_kls), abs=1e-9)
    assert metrics["kl_coef"] == 0.1
    ref_ctrl = AdaptiveKLController(0.1, target_kl=1.0, horizon=1000)
    ref_ctrl.update(current, B)
    assert ctrl.value == pytest.approx(ref_ctrl.value, rel=1e-12) and ctrl.value != 0.1

    ctrl3 = AdaptiveKLController(0.1, target_kl=1.0, horizon=1000)
    apply_kl_penalty(scores, lp, ref, mask, ctrl3, kind, update_kl_ctrl=False)
    assert ctrl3.value == 0.1


def test_token_kl_is_verls_reward_kl_penalty():
    """verl's reward_kl_penalty: token mean per response, then mean over responses (an empty row
    counts as 0). A 1-token response at KL 1.0, a 50-token one at 0.1 and an empty row: 0.3667
    (an all-token mean would give 6/51 = 0.1176)."""
    T = 50
    mask = torch.zeros(3, T)
    mask[0, 0] = 1
    mask[1, :] = 1
    ref = torch.zeros(3, T)
    lp = torch.zeros(3, T)
    lp[0, 0] = 1.0
    lp[1, :] = 0.1
    lp[2, :] = 5.0  # masked away
    _, metrics = apply_kl_penalty(torch.zeros(3, T), lp, ref, mask, FixedKLController(0.1), "k1")
    assert metrics["token_kl"] == pytest.approx((1.0 + 0.1 + 0.0) / 3, abs=1e-6)
    assert metrics["token_kl"] == pytest.approx(0.36667, abs=1e-5)
    assert metrics["current_kl"] == metrics["token_kl"]
    assert metrics["seq_kl"] == pytest.approx((1.0 + 5.0) / 2, abs=1e-5)


def test_adaptive_kl_stays_bounded_with_long_responses_at_target():
    """Every token at the target KL (0.1) on 500-token responses: the coefficient must not move
    (fed a per-sequence sum, 50 nats, it grew by +20% * n / horizon every step)."""
    B_, T_ = 8, 500
    mask = torch.ones(B_, T_)
    mask[1, 400:] = 0  # lengths differ; still 0.1 per token
    lp, ref = torch.full((B_, T_), 0.1), torch.zeros(B_, T_)
    ctrl = AdaptiveKLController(init_kl_coef=0.05, target_kl=0.1, horizon=100)
    for _ in range(50):
        apply_kl_penalty(torch.zeros(B_, T_), lp, ref, mask, ctrl, "k1")
    assert ctrl.value == pytest.approx(0.05, rel=1e-6)
    # and it still reacts: twice the target per token raises beta, half lowers it
    up, down = AdaptiveKLController(0.05, 0.1, 100), AdaptiveKLController(0.05, 0.1, 100)
    apply_kl_penalty(torch.zeros(B_, T_), 2 * lp, ref, mask, up, "k1")
    apply_kl_penalty(torch.zeros(B_, T_), 0.5 * lp, ref, mask, down, "k1")
    assert up.value == pytest.approx(0.05 * (1 + 0.2 * B_ / 100))
    assert down.value == pytest.approx(0.05 * (1 - 0.2 * B_ / 100))


def test_scores_at_last_valid_token_with_holes():
    mask = torch.tensor([[1, 1, 0, 1, 0, 0],    # hole at 2: last valid is 3, not count-1 = 2
                         [0, 0, 0, 0, 0, 0],    # empty
                         [1, 0, 0, 0, 0, 1],    # last valid 5
                         [1, 1, 1, 0, 0, 0]])
    out = scores_at_last_token(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    want = torch.zeros(4, 6)
    want[0, 3], want[2, 5], want[3, 2] = 1.0, 3.0, 4.0
    assert torch.equal(out, want)
    assert torch.equal(scores_at_last_token(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask.bool()), want)
    with pytest.raises(ValueError, match="one per row"):
        scores_at_last_token(torch.ones(3), mask)


def test_compute_gae_without_whitening_is_raw():
    mask = make_mask(40)
    rewards, values = randn(41, B, T), randn(42, B, T)
    adv_w, ret = compute_gae(rewards, values, mask, 0.99, 0.9)
    raw, ret2 = compute_gae(rewards, values, mask, 0.99, 0.9, whiten=False)
    torch.testing.assert_close(ret2, ret, rtol=0, atol=0)
    torch.testing.assert_close(raw, torch.where(mask > 0, ret - values, torch.zeros(())), **TOL)
    torch.testing.assert_close(masked_whiten(raw, mask), adv_w, **TOL)
    assert not torch.allclose(raw, adv_w)
