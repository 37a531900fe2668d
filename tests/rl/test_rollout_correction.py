"""Rollout correction (``rl/algorithms/rollout_correction.py``) against verl 0.9.1's
``rollout_corr_helper`` (verbatim copies in tests/helpers/verl_rollout_corr.py) on random inputs,
float64 and float32, masks with empty rows; the geometric level against a from-the-paper
reference; the seam into every policy loss; and 2-step runs of the built-in job per mode.

Conventions that differ from verl on purpose (documented in the module): ``chi2_seq`` and
``rejected_seq_share`` average over non-empty responses (verl over every row), so those two are
compared on inputs without empty rows.
"""

from __future__ import annotations

import math

import pytest
import torch

from parallel_models.rl.algorithms import losses
from parallel_models.rl.algorithms import rollout_correction as rc
from tests.helpers import verl_rollout_corr as verl

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}
MTOL = {torch.float64: 1e-9, torch.float32: 1e-5}  # metrics (accumulated in float64 here)


def _inputs(dtype, empty_rows=True, seed=0, B=8, R=12):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, R, generator=g, dtype=torch.float64) * 3
    old = rollout + torch.randn(B, R, generator=g, dtype=torch.float64) * 0.3
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    if empty_rows:
        lengths[1] = 0
        lengths[5] = 0
    mask = (torch.arange(R)[None] < lengths[:, None]).to(dtype)
    old[mask == 0] = 7.0  # padding garbage: must not matter
    return old.to(dtype), rollout.to(dtype), mask


def _close(a, b, dtype, what):
    assert math.isclose(a, b, rel_tol=MTOL[dtype], abs_tol=MTOL[dtype]), f"{what}: {a} vs {b}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_weights_equal_verl(dtype, level, mode):
    old, rollout, mask = _inputs(dtype)
    hi, lo = (1.5, None) if mode == "truncate" else (1.3, 0.7)
    spec = hi if mode == "truncate" else f"{lo}_{hi}"
    want, vm = verl.compute_rollout_correction_weights(old - rollout, mask, rollout_is=level,
                                                       rollout_is_threshold=spec)
    settings = rc.CorrectionSettings(level, mode, hi, lo)
    got, new_mask, m = rc.correct(old, rollout, mask, settings)
    assert got.dtype == dtype and torch.equal(new_mask, mask)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert (want > 0).any() and (want[mask > 0] == 0).any() == (mode == "mask")
    _close(m["rollout_corr/weight_mean"], vm["rollout_is_mean"], dtype, "mean")
    if level == "token":  # verl's sequence max / min are of the raw (uncapped) ratios
        _close(m["rollout_corr/weight_max"], vm["rollout_is_max"], dtype, "max")
        _close(m["rollout_corr/weight_min"], vm["rollout_is_min"], dtype, "min")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", rc.REJECTION_STATISTICS)
def test_rejection_equals_verl(dtype, name):
    old, rollout, mask = _inputs(dtype, empty_rows=False, seed=1)
    lr = rc.log_ratio(old, rollout, mask)
    threshold = float(rc.rejection_statistic(lr, mask, name).median())
    want, vm = verl.compute_rollout_rejection_mask(old - rollout, mask, rollout_rs=name,
                                                   rollout_rs_threshold=threshold)
    settings = rc.CorrectionSettings(None, reject=name, reject_threshold=threshold)
    weights, got, m = rc.correct(old, rollout, mask, settings)
    assert weights is None and torch.equal(got, want)
    assert 0 < (got.sum(-1) == 0).sum() < len(got), "expected some rows rejected, some kept"
    _close(m["rollout_corr/rejected_token_share"], vm["rollout_rs_masked_fraction"], dtype, "tok")
    _close(m["rollout_corr/rejected_seq_share"], vm["rollout_rs_seq_masked_fraction"], dtype,
           "seq")
    # empty rows: the same kept rows (verl's seq share counts every row, ours non-empty ones)
    old, rollout, mask = _inputs(dtype, seed=2)
    want, _ = verl.compute_rollout_rejection_mask(old - rollout, mask, rollout_rs=name,
                                                  rollout_rs_threshold=threshold)
    assert torch.equal(rc.correct(old, rollout, mask, settings)[1], want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("empty_rows", [False, True])
def test_mismatch_metrics_equal_verl(dtype, empty_rows):
    old, rollout, mask = _inputs(dtype, empty_rows=empty_rows, seed=3)
    want = verl.compute_offpolicy_metrics(old, rollout, mask)
    _, _, m = rc.correct(old, rollout, mask, rc.CorrectionSettings("token", hi=2.0))
    _close(m["rollout_corr/k1_before"], want["kl"], dtype, "k1")
    _close(m["rollout_corr/k3_before"], want["k3_kl"], dtype, "k3")
    _close(m["rollout_corr/chi2_token_before"], want["chi2_token"], dtype, "chi2_token")
    if not empty_rows:
        _close(m["rollout_corr/chi2_seq_before"], want["chi2_seq"], dtype, "chi2_seq")
    else:  # ours: the mean over the non-empty responses
        rows = mask.sum(-1) > 0
        sub = verl.compute_offpolicy_metrics(old[rows], rollout[rows], mask[rows])
        _close(m["rollout_corr/chi2_seq_before"], sub["chi2_seq"], dtype, "chi2_seq")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_geometric_level_from_the_paper(dtype, mode):
    """w = exp(mean_t log(pi_train / pi_rollout)) per response, capped / masked; the mask's
    kept rows equal verl's seq_mean_k1 rejection with the bounds mirrored (its k1 is
    log(pi_rollout / pi_train))."""
    old, rollout, mask = _inputs(dtype, seed=4)
    hi, lo = 1.1, 0.9
    want = torch.zeros_like(old)
    for b in range(len(old)):
        n = int(mask[b].sum())
        if n == 0:
            continue
        g = math.exp(sum(float(old[b, t] - rollout[b, t]) for t in range(n)) / n)
        if mode == "truncate":
            want[b, :n] = min(g, hi)
        elif lo <= g <= hi:
            want[b, :n] = g
    settings = rc.CorrectionSettings("geometric", mode, hi, lo if mode == "mask" else None)
    got, _, m = rc.correct(old, rollout, mask, settings)
    torch.testing.assert_close(got, want, **TOL[dtype])
    if mode == "mask":
        kept, _ = verl.compute_rollout_rejection_mask(old - rollout, mask, rollout_rs="seq_mean_k1",
                                                      rollout_rs_threshold=f"{1 / hi}_{1 / lo}")
        assert torch.equal((got > 0).to(dtype), kept)
        assert 0 < m["rollout_corr/rejected_seq_share"] < 1


def test_tis_cap_is_the_token_truncate_mode():
    """actor.tis_cap=C gives the weights of the older truncated_is_weights bit for bit."""
    from types import SimpleNamespace

    old, rollout, mask = _inputs(torch.float32, seed=5)
    cfg = SimpleNamespace(tis_cap=2.0, rollout_correction=None)
    settings = rc.settings_from_config(cfg)
    assert settings == rc.CorrectionSettings("token", "truncate", 2.0)
    got, _, _ = rc.correct(old, rollout, mask, settings)
    want = losses.truncated_is_weights(old, rollout, 2.0)
    assert torch.equal(got[mask > 0], want[mask > 0]) and (got[mask == 0] == 0).all()


def _microbatch(seed=6, B=4, P=3, R=5, V=11):
    from parallel_models.rl.roles.model_roles import make_microbatches

    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 2, 0, 4])
    resp = (torch.arange(R)[None] < lengths[:, None]).long()
    attn = torch.cat([torch.ones(B, P, dtype=torch.long), resp], 1)
    batch = {"sequences": torch.randint(0, V, (B, P + R), generator=g), "attention_mask": attn,
             "prompt_lengths": torch.full((B,), P), "response_mask": resp,
             "old_log_probs": -torch.rand(B, R, generator=g) * 2,
             "advantages": torch.randn(B, R, generator=g),
             "rollout_is_weights": torch.rand(B, R, generator=g) * 2 * resp}
    mbs, _ = make_microbatches(batch, 10_000)
    assert len(mbs) == 1
    logits = torch.randn(int(attn.sum()), V, generator=g)
    return mbs[0], logits


@pytest.mark.parametrize("name", losses.POLICY_LOSSES.names())
def test_every_policy_loss_gets_the_weights(name):
    """The seam: model_roles.policy_loss hands the batch's rollout_is_weights to the policy loss
    as its token_weights (whatever the loss), and without them the loss differs."""
    from parallel_models.rl.config.sections import ActorSection
    from parallel_models.rl.roles.model_roles import _response_log_probs, policy_loss

    cfg = ActorSection(policy_loss=name)
    mb, logits = _microbatch()
    _, denom, metrics = policy_loss(logits, mb, cfg, 1.0)
    logp, _ = _response_log_probs(logits, mb, 1.0, False)
    fn = losses.POLICY_LOSSES.get(name)
    want, _ = fn(log_probs=logp, old_log_probs=mb["old_log_probs"], advantages=mb["advantages"],
                 response_mask=mb["response_mask"], config=cfg,
                 token_weights=mb["rollout_is_weights"])
    torch.testing.assert_close(metrics["pg_loss"] / denom, want.detach(), rtol=1e-6, atol=1e-7)
    plain, _ = fn(log_probs=logp, old_log_probs=mb["old_log_probs"], advantages=mb["advantages"],
                  response_mask=mb["response_mask"], config=cfg, token_weights=None)
    assert not torch.allclose(plain, want)


RUNS = {
    "token-truncate": ["actor.rollout_correction.level=token"],
    "sequence-truncate": ["actor.rollout_correction.level=sequence",
                          "actor.rollout_correction.hi=1.5"],
    "geometric-mask": ["actor.rollout_correction.level=geometric",
                       "actor.rollout_correction.mode=mask", "actor.rollout_correction.lo=0.9",
                       "actor.rollout_correction.hi=1.1"],
    "token-mask-reject": ["actor.rollout_correction.level=token",
                          "actor.rollout_correction.mode=mask",
                          "actor.rollout_correction.reject=seq_max_k3",
                          "actor.rollout_correction.reject_threshold=0.01"],
    "sequence-mask": ["actor.rollout_correction.level=sequence",
                      "actor.rollout_correction.mode=mask"],
    "tis_cap": ["actor.tis_cap=2.0"],
}


@pytest.mark.parametrize("run", list(RUNS))
def test_each_mode_trains_and_logs(tmp_path, run):
    """2 GRPO steps of the built-in job per level / mode: the actor trains and the correction's
    metrics are logged at every step."""
    from tests.helpers.ppo_runs import run_metrics, run_ppo

    out = str(tmp_path / run)
    run_ppo([f"trainer.output_dir={out}", "trainer.total_steps=2", "trainer.save_every=0",
             "trainer.loggers=[jsonl]", "trainer.save_hf_at_end=false",
             "algorithm.adv_estimator=grpo", "algorithm.kl_in_reward=false", "data.batch_size=4",
             "actor.mini_batch_size=8", "actor.ppo_epochs=1", *RUNS[run]])
    rows = run_metrics(out)
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["actor/pg_loss"])
        for key in ("weight_mean", "weight_min", "weight_max", "rejected_token_share",
                    "rejected_seq_share", "k1_before", "k3_before", "chi2_token_before",
                    "chi2_seq_before", "k1_after", "k3_after", "chi2_token_after",
                    "chi2_seq_after"):
            assert math.isfinite(r[f"rollout_corr/{key}"]), (key, r)
        assert 0.0 <= r["rollout_corr/weight_min"] <= r["rollout_corr/weight_max"]


def test_rejected_responses_stop_training_but_keep_their_group_baseline():
    """The advantage phase with a rejection: the rejected rows' masks are zeroed after the
    advantages, so the kept rows' GRPO advantages are those of the run without rejection."""
    from types import SimpleNamespace

    from parallel_models.rl.config.ppo import load_config
    from parallel_models.rl.data.batch import RolloutBatch
    from parallel_models.rl.trainer import PPOTrainer

    old, rollout, mask = _inputs(torch.float32, empty_rows=False, seed=7)
    B, R = mask.shape
    batch = lambda: RolloutBatch(  # noqa: E731
        sequences=torch.zeros(B, R + 2, dtype=torch.long),
        attention_mask=torch.ones(B, R + 2, dtype=torch.long), prompt_lengths=torch.full((B,), 2),
        response_mask=mask.long(), group_index=torch.arange(B) // 4,
        old_log_probs=old, rollout_log_probs=rollout, scores=torch.linspace(0, 1, B))
    base = ["algorithm.adv_estimator=grpo", "algorithm.kl_in_reward=false"]
    reject = ["actor.rollout_correction.reject=seq_mean_k2",
              "actor.rollout_correction.reject_threshold=0.04"]
    runs = {}
    for name, extra in (("plain", []), ("reject", reject)):
        trainer = SimpleNamespace(cfg=load_config(overrides=base + extra), kl_ctrl=None)
        b = batch()
        metrics = PPOTrainer.advantage_phase(trainer, b)
        runs[name] = (b, metrics)
    (plain, _), (rejected, metrics) = runs["plain"], runs["reject"]
    gone = rejected.response_mask.sum(-1) == 0
    assert 0 < int(gone.sum()) < B and metrics["rollout_corr/rejected_seq_share"] > 0
    kept = ~gone
    assert torch.equal(rejected.advantages[kept], plain.advantages[kept])
    assert torch.equal(rejected.response_mask[kept], plain.response_mask[kept])
