"""Tests for parallel_models.rl.algorithms against plain Python-loop references.

Every reference below loops over batch and time on Python floats (no
vectorization), so a broadcasting or masking mistake in the torch code cannot
be mirrored by the reference.
"""

import math

import pytest
import torch

from parallel_models.rl.algorithms import (
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
from parallel_models.rl.losses import (
    agg_denominator,
    agg_loss,
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
    entropy_from_logits,
)

TOL = dict(rtol=1e-6, atol=1e-6)
B, T = 7, 11


def make_mask(seed=0, batch=B, length=T, empty_row=True):
    """Mask with different lengths per row, holes inside rows, and one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, length, dtype=torch.float64)
    for b in range(batch):
        n = int(torch.randint(1, length + 1, (1,), generator=g))
        mask[b, :n] = 1.0
        # Punch holes strictly inside the valid span so they are real holes.
        for t in range(1, n - 1):
            if torch.rand((), generator=g) < 0.3:
                mask[b, t] = 0.0
    # Row 0 always runs to the end with a two-token hole in the middle.
    mask[0] = 1.0
    mask[0, 3:5] = 0.0
    if empty_row:
        mask[batch // 2] = 0.0
    # Make sure the fixture really has holes (guards the tests' own premise).
    assert any(
        mask[b, t] == 0 and mask[b, t + 1:].sum() > 0 and mask[b, :t].sum() > 0
        for b in range(batch)
        for t in range(length)
    )
    return mask


def randn(seed, *shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def rows(t):
    return t.tolist()


# ---------------------------------------------------------------------------
# Loop references
# ---------------------------------------------------------------------------


def ref_masked_mean_all(x, mask):
    s, n = 0.0, 0
    for xr, mr in zip(rows(x), rows(mask)):
        for xv, mv in zip(xr, mr):
            if mv:
                s += xv
                n += 1
    return s / n if n else 0.0


def ref_masked_var_all(x, mask, unbiased=True):
    vals = [xv for xr, mr in zip(rows(x), rows(mask)) for xv, mv in zip(xr, mr) if mv]
    n = len(vals)
    if n == 0 or (unbiased and n == 1):
        return 0.0
    mean = sum(vals) / n
    ss = sum((v - mean) ** 2 for v in vals)
    return ss / (n - 1) if unbiased else ss / n


def ref_whiten(x, mask, shift_mean=True):
    mean = ref_masked_mean_all(x, mask)
    var = ref_masked_var_all(x, mask, unbiased=True)
    out = []
    for xr, mr in zip(rows(x), rows(mask)):
        row = []
        for xv, mv in zip(xr, mr):
            if mv:
                w = (xv - mean) / math.sqrt(var + 1e-8)
                if not shift_mean:
                    w += mean
                row.append(w)
            else:
                row.append(0.0)
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def ref_gae(rewards, values, mask, gamma, lam):
    """verl-style recursion with the (1 - mask) pass-through, written per element."""
    R, V, M = rows(rewards), rows(values), rows(mask)
    adv = [[0.0] * len(R[0]) for _ in R]
    for b in range(len(R)):
        nextvalue, lastgaelam = 0.0, 0.0
        for t in reversed(range(len(R[b]))):
            delta = R[b][t] + gamma * nextvalue - V[b][t]
            cand = delta + gamma * lam * lastgaelam
            m = M[b][t]
            nextvalue = V[b][t] * m + (1 - m) * nextvalue
            lastgaelam = cand * m + (1 - m) * lastgaelam
            adv[b][t] = lastgaelam
    ret = [[(adv[b][t] + V[b][t]) if M[b][t] else 0.0 for t in range(len(R[b]))] for b in range(len(R))]
    adv_t = torch.tensor(adv, dtype=torch.float64)
    return ref_whiten(adv_t, mask), torch.tensor(ret, dtype=torch.float64)


def ref_returns(rewards, mask, gamma):
    R, M = rows(rewards), rows(mask)
    out = [[0.0] * len(R[0]) for _ in R]
    for b in range(len(R)):
        running = 0.0
        for t in reversed(range(len(R[b]))):
            if M[b][t]:
                running = R[b][t] + gamma * running
                out[b][t] = running
    return torch.tensor(out, dtype=torch.float64)


def ref_group_adv(scores, groups, mask, kind, norm_by_std=True, eps=1e-6):
    S = scores.tolist()
    G = [int(g) for g in groups]
    adv = []
    for i, s in enumerate(S):
        members = [S[j] for j in range(len(S)) if G[j] == G[i]]
        n = len(members)
        if n == 1:
            a = 0.0
        elif kind == "grpo":
            mean = sum(members) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
            a = (s - mean) / (std + eps) if norm_by_std else s - mean
        else:  # rloo
            a = s - (sum(members) - s) / (n - 1)
        adv.append(a)
    M = rows(mask)
    out = [[adv[b] if M[b][t] else 0.0 for t in range(len(M[b]))] for b in range(len(M))]
    return torch.tensor(out, dtype=torch.float64)


def ref_kl(lp, ref, kind):
    d = lp - ref
    if kind == "k1":
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    x = ref - lp
    return min(max(math.exp(x) - x - 1, -10.0), 10.0)


def ref_agg(loss, mask, mode):
    L, M = rows(loss), rows(mask)
    if mode == "token-mean":
        return ref_masked_mean_all(loss, mask)
    seq = []
    for lr, mr in zip(L, M):
        valid = [lv for lv, mv in zip(lr, mr) if mv]
        if not valid:
            continue
        seq.append(sum(valid) if mode == "seq-mean-token-sum" else sum(valid) / len(valid))
    return sum(seq) / len(seq) if seq else 0.0


def ref_policy_loss(old, new, adv, mask, lo, hi, c, mode):
    O, N, A, M = rows(old), rows(new), rows(adv), rows(mask)
    losses, n, nclip, nlower, kl = [], 0, 0, 0, 0.0
    for b in range(len(O)):
        row = []
        for t in range(len(O[b])):
            if not M[b][t]:
                row.append(0.0)
                continue
            r = math.exp(N[b][t] - O[b][t])
            a = A[b][t]
            l1 = -a * r
            l2 = -a * min(max(r, 1 - lo), 1 + hi)
            l = max(l1, l2)
            nclip += l2 > l1
            if c is not None and a < 0:
                l3 = -a * c
                nlower += l > l3
                l = min(l, l3)
            row.append(l)
            n += 1
            kl += O[b][t] - N[b][t]
        losses.append(row)
    loss = ref_agg(torch.tensor(losses, dtype=torch.float64), mask, mode)
    return loss, nclip / max(n, 1), nlower / max(n, 1), kl / max(n, 1)


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


# ---------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_agg_loss_matches_loop(mode):
    mask = make_mask(24)
    loss = randn(25, B, T).requires_grad_(True)
    out = agg_loss(loss, mask, mode)
    assert out.item() == pytest.approx(ref_agg(loss.detach(), mask, mode), abs=1e-9)
    out.backward()
    assert (loss.grad[mask == 0] == 0).all()
    # All-zero mask: 0 loss with a finite gradient, no NaN.
    x = torch.full((3, 4), float("nan"), dtype=torch.float64, requires_grad=True)
    z = agg_loss(x, torch.zeros(3, 4), mode)
    z.backward()
    assert z.item() == 0.0 and torch.isfinite(x.grad).all()


def test_agg_loss_modes_differ_and_unknown_raises():
    mask = make_mask(26)
    loss = randn(27, B, T).abs()
    vals = {m: agg_loss(loss, mask, m).item() for m in ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]}
    assert len({round(v, 9) for v in vals.values()}) == 3
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        agg_loss(loss, mask, "token-sum")
    with pytest.raises(ValueError):
        compute_policy_loss(loss, loss, loss, mask, loss_agg_mode="bogus")
    with pytest.raises(ValueError):
        compute_entropy_loss(loss, mask, "bogus")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_agg_denominator_splits_a_global_mean(mode):
    """Loss x denominator summed over two halves / summed denominators == the whole batch's loss."""
    mask = make_mask(28)
    loss = randn(29, B, T)
    parts = [(agg_loss(loss[i], mask[i], mode), agg_denominator(mask[i], mode))
             for i in (slice(0, 3), slice(3, B))]
    total = sum(l * d for l, d in parts) / sum(d for _, d in parts)
    torch.testing.assert_close(total, agg_loss(loss, mask, mode), **TOL)
    with pytest.raises(ValueError, match="token-mean"):
        agg_denominator(mask, "bogus")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("lo,hi,c", [(0.2, 0.2, 3.0), (0.1, 0.28, 2.0), (0.2, 0.2, None)])
def test_policy_loss_matches_loop(mode, lo, hi, c):
    mask = make_mask(28)
    old = -randn(29, B, T).abs()
    new = old + randn(30, B, T) * 0.8  # large enough for both clips to trigger
    adv = randn(31, B, T)
    # -inf in padding must not produce NaN in the loss or the gradient.
    new = torch.where(mask.bool(), new, torch.tensor(-float("inf"), dtype=torch.float64)).requires_grad_(True)
    loss, metrics = compute_policy_loss(old, new, adv, mask, lo, hi, c, mode)
    ref_loss, clipfrac, lower, kl = ref_policy_loss(old, new.detach(), adv, mask, lo, hi, c, mode)
    assert loss.item() == pytest.approx(ref_loss, abs=1e-9)
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipfrac, abs=1e-12)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(lower, abs=1e-12)
    assert metrics["ppo_kl"].item() == pytest.approx(kl, abs=1e-9)
    assert clipfrac > 0
    if c is not None:
        assert lower > 0
    loss.backward()
    assert torch.isfinite(new.grad).all() and (new.grad[mask == 0] == 0).all()


def test_policy_loss_gradient_matches_loop_autograd():
    mask = make_mask(32)
    old = -randn(33, B, T).abs()
    new = (old + randn(34, B, T) * 0.8).requires_grad_(True)
    adv = randn(35, B, T)
    loss, _ = compute_policy_loss(old, new, adv, mask, 0.2, 0.2, 3.0, "seq-mean-token-mean")
    (g,) = torch.autograd.grad(loss, new)
    # Reference gradient from a scalar, per-element autograd build of the same objective.
    new2 = new.detach().clone().requires_grad_(True)
    seq_terms = []
    for b in range(B):
        toks = []
        for t in range(T):
            if mask[b, t]:
                r = torch.exp(new2[b, t] - old[b, t])
                a = adv[b, t]
                l = torch.maximum(-a * r, -a * torch.clamp(r, 0.8, 1.2))
                if a < 0:
                    l = torch.minimum(l, -a * 3.0)
                toks.append(l)
        if toks:
            seq_terms.append(sum(toks) / len(toks))
    (g_ref,) = torch.autograd.grad(sum(seq_terms) / len(seq_terms), new2)
    torch.testing.assert_close(g, g_ref, **TOL)


def test_dual_clip_triggers_and_changes_loss():
    # Negative advantages with ratios far above clip_ratio_c.
    old = torch.zeros(2, 4, dtype=torch.float64)
    new = torch.tensor([[2.0, 1.5, 0.0, 0.1], [3.0, -0.5, 0.05, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, -2.0, 0.5, -0.3], [-0.7, 1.0, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float64)
    dual, m_dual = compute_policy_loss(old, new, adv, mask, clip_ratio_c=3.0)
    plain, m_plain = compute_policy_loss(old, new, adv, mask, clip_ratio_c=None)
    # Tokens (0,0), (1,0) have ratio e^2, e^3 > 3 with A < 0; (0,1) has e^1.5 > 3 too.
    # (Token (1,1): A > 0 and ratio < 1 - eps is *not* clipped; the unclipped term is pessimistic.)
    assert m_dual["pg_clipfrac_lower"].item() == pytest.approx(3 / 7)
    assert m_plain["pg_clipfrac_lower"].item() == 0.0
    assert dual.item() < plain.item()
    # Exact value of the dual-clipped loss, by hand.
    per_tok = [3.0 * 1.0, 3.0 * 2.0, -0.5 * 1.0, 0.3 * math.exp(0.1), 3.0 * 0.7, -math.exp(-0.5), 1.0 * math.exp(0.05)]
    assert dual.item() == pytest.approx(sum(per_tok) / 7, abs=1e-12)
    with pytest.raises(ValueError):
        compute_policy_loss(old, new, adv, mask, clip_ratio_c=1.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_matches_loop(mode, clip):
    mask = make_mask(36)
    old = randn(37, B, T)
    vpred = old + randn(38, B, T) * 0.5
    ret = randn(39, B, T)
    loss, metrics = compute_value_loss(vpred, old, ret, mask, clip, mode)
    V, O, R, M = rows(vpred), rows(old), rows(ret), rows(mask)
    per, n, nclip = [], 0, 0
    for b in range(B):
        row = []
        for t in range(T):
            if not M[b][t]:
                row.append(0.0)
                continue
            l1 = (V[b][t] - R[b][t]) ** 2
            l = l1
            if clip is not None:
                vc = min(max(V[b][t], O[b][t] - clip), O[b][t] + clip)
                l2 = (vc - R[b][t]) ** 2
                nclip += l2 > l1
                l = max(l1, l2)
            row.append(l)
            n += 1
        per.append(row)
    expected = 0.5 * ref_agg(torch.tensor(per, dtype=torch.float64), mask, mode)
    assert loss.item() == pytest.approx(expected, abs=1e-9)
    assert metrics["vf_clipfrac"].item() == pytest.approx(nclip / n, abs=1e-12)
    if clip is not None:
        assert nclip > 0


def test_entropy_from_logits_matches_loop():
    logits = randn(40, 3, 4, 9) * 3
    logits[0, 0, 2] += 1e4  # huge logit: naive exp would overflow
    logits[1, 2, :4] = -float("inf")  # banned tokens
    logits = logits.requires_grad_(True)
    ent = entropy_from_logits(logits)
    expected = []
    for row in logits.detach().reshape(-1, 9).tolist():
        mx = max(row)
        z = sum(math.exp(v - mx) for v in row)
        h = 0.0
        for v in row:
            p = math.exp(v - mx) / z
            if p > 0:
                h -= p * math.log(p)
        expected.append(h)
    torch.testing.assert_close(ent.reshape(-1), torch.tensor(expected, dtype=torch.float64), **TOL)
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()
    # Cross-check with torch.distributions on finite rows.
    finite = logits.detach()[0]
    torch.testing.assert_close(
        entropy_from_logits(finite), torch.distributions.Categorical(logits=finite).entropy(), **TOL
    )
    # bf16 input is upcast and stays close to the float64 answer.
    ent_bf16 = entropy_from_logits(logits.detach()[2].to(torch.bfloat16))
    assert ent_bf16.dtype == torch.float32
    torch.testing.assert_close(ent_bf16.double(), ent[2].detach(), rtol=0, atol=0.05)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_compute_entropy_loss(mode):
    mask = make_mask(41)
    ent = randn(42, B, T).abs()
    assert compute_entropy_loss(ent, mask, mode).item() == pytest.approx(ref_agg(ent, mask, mode), abs=1e-9)
