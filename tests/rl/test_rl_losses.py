"""parallel_models.rl.algorithms.losses (loss aggregation modes, clipped and dual-clip policy loss and its
gradient, clipped value loss, entropy) against the plain Python-loop references of
tests/helpers/rl_loop_references.py."""

import math

import pytest
import torch

from parallel_models.rl.algorithms.losses import (
    LOSS_AGG_MODES,
    agg_denominator,
    agg_loss,
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
    entropy_from_logits,
)
from tests.helpers.rl_loop_references import (
    B,
    T,
    TOL,
    make_mask,
    randn,
    ref_agg,
    ref_policy_loss,
    rows,
)


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
    vals = {m: agg_loss(loss, mask, m).item() for m in LOSS_AGG_MODES}
    assert len({round(v, 9) for v in vals.values()}) == len(LOSS_AGG_MODES) == 5
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        agg_loss(loss, mask, "token-summ")
    with pytest.raises(ValueError):
        compute_policy_loss(loss, loss, loss, mask, loss_agg_mode="bogus")
    with pytest.raises(ValueError):
        compute_entropy_loss(loss, mask, "bogus")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
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


def test_token_sum_weighs_each_microbatch_sum_once():
    """token-sum: every microbatch's denominator is 1, so the step's loss is the mean of the
    microbatches' token sums (with one microbatch: the token sum itself)."""
    mask = make_mask(30)
    loss = randn(31, B, T)
    halves = (slice(0, 3), slice(3, B))
    parts = [(agg_loss(loss[i], mask[i], "token-sum"), agg_denominator(mask[i], "token-sum"))
             for i in halves]
    assert all(int(d) == 1 for _, d in parts)
    total = sum(l * d for l, d in parts) / sum(d for _, d in parts)
    torch.testing.assert_close(total, agg_loss(loss, mask, "token-sum") / 2, **TOL)
    torch.testing.assert_close(agg_loss(loss, mask, "token-sum"),
                               (loss * (mask > 0)).sum(), **TOL)


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
