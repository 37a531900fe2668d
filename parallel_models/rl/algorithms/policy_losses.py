"""The policy losses beyond clipped PPO (``actor.policy_loss``): ``gspo``, ``geo_mean`` (GMPO),
``cispo``, ``clip_cov``, ``kl_cov`` and ``gpg``. Each has the signature of
:data:`~parallel_models.rl.algorithms.losses.POLICY_LOSSES` (that module registers them by name
and imports this one on first use), declares its metrics in ``fn.metrics`` and aggregates with
``actor.loss_agg_mode`` (:func:`~parallel_models.rl.algorithms.losses.aggregate`), so the
caller's entropy bonus, KL loss, microbatch weighting and metrics are the same for all.

Notation per token ``t`` of response ``i``: ``r = exp(logp - old_logp)`` the importance ratio,
``A`` the advantage, ``eps_lo`` / ``eps_hi`` the actor's ``clip_ratio_low`` / ``clip_ratio_high``.
The math follows verl 0.9.1's ``core_algos.py`` (tests/rl/test_algorithms_vs_verl.py compares on
random inputs); masked positions are selected away with ``torch.where`` before any ``exp``, so
padding garbage never reaches a value or a gradient. ``token_weights`` (rollout correction, no
gradient) multiply the per-token loss as in :func:`~parallel_models.rl.algorithms.losses.
compute_policy_loss`.
"""

from __future__ import annotations

import torch

from parallel_models.rl.algorithms.core import as_bool_mask, masked_mean, masked_sum
from parallel_models.rl.algorithms.losses import aggregate

__all__ = ["gspo_policy_loss", "geo_mean_policy_loss", "cispo_policy_loss",
           "clip_cov_policy_loss", "kl_cov_policy_loss", "gpg_policy_loss"]

# exp(20) is far outside any clip range; the clamp only keeps exp (and its gradient) finite
_LOG_RATIO_BOUND = 20.0


def _masked_inputs(log_probs, old_log_probs, advantages, response_mask):
    """``(mask, log_ratio, advantages, log_probs)`` with masked positions set to 0."""
    m = as_bool_mask(response_mask, log_probs)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    log_ratio = torch.where(m, log_probs - old_log_probs, zero)
    adv = torch.where(m, advantages.to(log_probs.dtype), zero)
    return m, log_ratio, adv, torch.where(m, log_probs, zero)


def _weighted(pg_losses, m, token_weights):
    if token_weights is None:
        return pg_losses
    zero = torch.zeros((), dtype=pg_losses.dtype, device=pg_losses.device)
    return pg_losses * torch.where(m, token_weights.detach().to(pg_losses.dtype), zero)


def gspo_policy_loss(log_probs, old_log_probs, advantages, response_mask, config,
                     token_weights=None):
    """GSPO, Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071): one
    importance ratio per sequence, the geometric mean of its token ratios::

        s_i = exp( mean_t (logp_t - old_logp_t) )                      (sequence ratio)
        s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]                         (same value, token grads)
        loss_t = max(-A_t * s_it, -A_t * clip(s_it, 1 - eps_lo, 1 + eps_hi))

    aggregated by ``actor.loss_agg_mode`` (the paper: ``seq-mean-token-mean``). The log of
    ``s_it`` is clamped at 10 as in verl. Metrics: ``pg_clipfrac`` (tokens whose clipped term
    is the larger), ``ppo_kl`` (token mean of ``old_logp - logp``)."""
    m, log_ratio, adv, logp = _masked_inputs(log_probs, old_log_probs, advantages, response_mask)
    seq_log_ratio = masked_sum(log_ratio, m, dim=-1) / m.sum(dim=-1).clamp_min(1)
    log_s = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_s, max=10.0))
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    pg_losses = _weighted(torch.maximum(pg_losses1, pg_losses2), m, token_weights)
    metrics = {"pg_clipfrac": masked_mean((pg_losses2 > pg_losses1).to(logp.dtype), m).detach(),
               "ppo_kl": masked_mean(-log_ratio, m).detach()}
    return aggregate(pg_losses, m, config), metrics


gspo_policy_loss.metrics = ("pg_clipfrac", "ppo_kl")


def geo_mean_policy_loss(log_probs, old_log_probs, advantages, response_mask, config,
                         token_weights=None):
    """GMPO, Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv:2507.20673): the
    sequence's objective is the geometric mean of its token ratios, each clipped in log space::

        l_t   = sgn(A) * min(sgn(A) * log r_t, sgn(A) * clip(log r_t, -eps_lo, eps_hi))
        loss_i = -mean_t(A_t) * exp( mean_t l_t )

    Convention: the sequence loss is spread over the sequence's valid tokens and aggregated by
    ``actor.loss_agg_mode``; with ``seq-mean-token-mean`` that is verl's mean over sequences
    (verl ignores the mode and also counts all-padding rows, with loss 0, in the mean; here
    they are left out as in every sequence mode). ``token_weights`` enter as their per-sequence
    geometric mean (verl's). Metrics: ``pg_clipfrac`` / ``pg_clipfrac_lower`` (tokens whose
    log-ratio was clipped with A > 0 / A < 0), ``ppo_kl``."""
    m, log_ratio, adv, _ = _masked_inputs(log_probs, old_log_probs, advantages, response_mask)
    sign = torch.sign(adv)
    clamped = torch.clamp(log_ratio, -config.clip_ratio_low, config.clip_ratio_high)
    chosen = sign * torch.minimum(sign * log_ratio, sign * clamped)
    count = m.sum(dim=-1).clamp_min(1)
    ratio = torch.exp(masked_sum(chosen, m, dim=-1) / count)
    seq_adv = masked_sum(adv, m, dim=-1) / count
    seq_losses = -seq_adv * ratio
    if token_weights is not None:
        logw = torch.where(m, torch.log(token_weights.detach().to(ratio.dtype) + 1e-10),
                           torch.zeros((), dtype=ratio.dtype, device=ratio.device))
        seq_losses = seq_losses * torch.exp(logw.sum(dim=-1) / count)
    pg_losses = torch.where(m, seq_losses.unsqueeze(-1),
                            torch.zeros((), dtype=ratio.dtype, device=ratio.device))
    clipped = (log_ratio != clamped).to(ratio.dtype)
    metrics = {"pg_clipfrac": masked_mean(clipped * (adv > 0), m).detach(),
               "pg_clipfrac_lower": masked_mean(clipped * (adv < 0), m).detach(),
               "ppo_kl": masked_mean(-log_ratio, m).detach()}
    return aggregate(pg_losses, m, config), metrics


geo_mean_policy_loss.metrics = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")


def cispo_policy_loss(log_probs, old_log_probs, advantages, response_mask, config,
                      token_weights=None):
    """CISPO, Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585): REINFORCE
    with the clipped importance weight as a constant, so every token keeps its gradient::

        loss_t = -sg[clip(r_t, 1 - eps_lo, 1 + eps_hi)] * A_t * logp_t

    Metrics: ``pg_clipfrac`` (tokens whose ratio was clipped), ``ppo_kl``."""
    m, log_ratio, adv, logp = _masked_inputs(log_probs, old_log_probs, advantages, response_mask)
    log_ratio = torch.clamp(log_ratio, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    pg_losses = _weighted(-clipped_ratio.detach() * adv * logp, m, token_weights)
    metrics = {"pg_clipfrac": masked_mean((ratio != clipped_ratio).to(logp.dtype), m).detach(),
               "ppo_kl": masked_mean(-log_ratio, m).detach()}
    return aggregate(pg_losses, m, config), metrics


cispo_policy_loss.metrics = ("pg_clipfrac", "ppo_kl")


def _centered_product(adv, logp, m):
    """Per-token ``(A - mean A) * (logp - mean logp)`` over the valid tokens (the covariance
    terms of Cui et al. 2025), without gradient."""
    logp = logp.detach()
    return (adv - masked_mean(adv, m)) * (logp - masked_mean(logp, m))


def clip_cov_policy_loss(log_probs, old_log_probs, advantages, response_mask, config,
                         token_weights=None):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs",
    arXiv:2505.22617): the clipped PPO loss (no dual clip), with the gradient detached on a
    random ``clip_cov_ratio`` share of the tokens whose covariance term
    ``(A - mean A)(logp - mean logp)`` lies in ``(clip_cov_lb, clip_cov_ub)`` and that PPO
    did not clip already (those tokens drive the entropy collapse)::

        loss_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_lo, 1 + eps_hi)) * (0 if t chosen else 1)

    The choice draws from torch's global generator (``torch.randperm``, as verl).
    Metrics: ``pg_clipfrac`` (share of tokens chosen), ``ppo_kl``."""
    m, log_ratio, adv, logp = _masked_inputs(log_probs, old_log_probs, advantages, response_mask)
    ratio = torch.exp(torch.clamp(log_ratio, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    cov = _centered_product(adv, logp, m)
    eligible = m & ~(pg_losses2 > pg_losses1) & (cov < config.clip_cov_ub) & \
        (cov > config.clip_cov_lb)
    clip_num = max(int(config.clip_cov_ratio * int(m.sum())), 1)
    candidates = torch.nonzero(eligible)
    corr = torch.ones_like(adv)
    if len(candidates) > 0:
        chosen = candidates[torch.randperm(len(candidates))[:min(clip_num, len(candidates))]]
        corr[chosen[:, 0], chosen[:, 1]] = 0
    pg_losses = _weighted(torch.maximum(pg_losses1, pg_losses2) * corr, m, token_weights)
    metrics = {"pg_clipfrac": masked_mean((corr == 0).to(logp.dtype), m).detach(),
               "ppo_kl": masked_mean(-log_ratio, m).detach()}
    return aggregate(pg_losses, m, config), metrics


clip_cov_policy_loss.metrics = ("pg_clipfrac", "ppo_kl")


def kl_cov_policy_loss(log_probs, old_log_probs, advantages, response_mask, config,
                       token_weights=None):
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617): the unclipped policy gradient
    ``-A_t r_t``, plus a KL penalty ``ppo_kl_coef * |log r_t|`` on the ``kl_cov_ratio`` share
    of tokens with the largest covariance term ``(A - mean A)(logp - mean logp)``::

        loss_t = -A_t r_t + (ppo_kl_coef * |log r_t| if t in top-k(cov) else 0)

    Metrics: ``ppo_kl_abs`` (token mean of ``|logp - old_logp|``; verl logs it as ppo_kl)."""
    m, log_ratio, adv, logp = _masked_inputs(log_probs, old_log_probs, advantages, response_mask)
    ratio = torch.exp(torch.clamp(log_ratio, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    pg_losses = -adv * ratio
    flat_valid = torch.nonzero(m.reshape(-1), as_tuple=True)[0]
    if len(flat_valid):
        cov = _centered_product(adv, logp, m).reshape(-1)[flat_valid]
        k = max(1, int(len(cov) * config.kl_cov_ratio))
        top = flat_valid[torch.topk(cov, k, largest=True).indices]
        penalty = torch.zeros(m.numel(), dtype=pg_losses.dtype, device=pg_losses.device)
        penalty[top] = config.ppo_kl_coef
        pg_losses = pg_losses + penalty.view_as(pg_losses) * log_ratio.abs()
    pg_losses = _weighted(pg_losses, m, token_weights)
    return aggregate(pg_losses, m, config), {"ppo_kl_abs": masked_mean(log_ratio.abs(), m).detach()}


kl_cov_policy_loss.metrics = ("ppo_kl_abs",)


def gpg_policy_loss(log_probs, old_log_probs, advantages, response_mask, config,
                    token_weights=None):
    """GPG, Group Policy Gradient (Chu et al. 2025, arXiv:2504.02546): plain REINFORCE on the
    current log-probs, no ratio and no clipping (pair it with the ``gpg`` estimator)::

        loss_t = -A_t * logp_t

    No metrics."""
    del old_log_probs
    m, _, adv, logp = _masked_inputs(log_probs, log_probs, advantages, response_mask)
    pg_losses = _weighted(-logp * adv, m, token_weights)
    return aggregate(pg_losses, m, config), {}
