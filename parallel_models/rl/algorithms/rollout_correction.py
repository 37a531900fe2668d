"""Rollout correction: importance weights and rejection for the training-inference mismatch
(the sampler's log-probs ``rollout_log_probs`` differ from the training engine's ``old_log_probs``
of the same tokens: other kernels, precision, stale weights).

With the per-token log ratio ``l_t = old_t - rollout_t`` (``log pi_train / pi_rollout``, clamped
to +-20 before any exp, as verl), ``actor.rollout_correction`` sets

* ``level``: ``token``: ``rho_t = exp(l_t)`` (Yao et al. 2025, "Your efficient RL framework
  secretly brings you off-policy RL training", truncated IS); ``sequence``: one weight per
  response, ``rho = exp(sum_t l_t)`` (the unbiased sequence-level ratio); ``geometric``:
  ``rho = exp(mean_t l_t)``, the geometric mean of the token ratios (length-normalised sequence
  ratio, as GSPO's / GMPO's sequence ratio; Zheng et al. 2025, arXiv:2507.18071);
* ``mode``: ``truncate``: ``w = min(rho, hi)`` (TIS); ``mask``: ``w = rho`` inside
  ``[lo, hi]`` and 0 outside (IcePop, "Small leak can sink a great ship", Ling team 2025;
  at sequence / geometric level the whole response), so those tokens / responses carry no
  gradient (they stay in the loss's denominators, as verl's IcePop);
* ``reject`` / ``reject_threshold``: responses whose mismatch statistic (verl's rejection
  options ``seq_{sum,mean,max}_k{2,3}``, with ``k2 = l^2 / 2``, ``k3 = exp(l) - 1 - l``) exceeds
  the threshold stop training: their ``response_mask`` becomes 0 (verl's rollout rejection
  sampling, Liu et al. 2025, "When speed kills stability"). The trainer zeroes it after the
  advantages, so a rejected response's reward still counts in its group's baseline (verl's group
  estimators read the rewards, not the mask; unlike verl, GAE's batch whitening also sees it).

``actor.tis_cap = C`` (the older key) is ``level=token, mode=truncate, hi=C``.

The weights (no gradient) go into the batch as ``rollout_is_weights`` and reach every policy
loss as its ``token_weights`` (``rl/roles/model_roles.py``), which multiply the per-token loss
before aggregation. Token and sequence levels equal verl 0.9.1's
``compute_rollout_correction_weights`` (``rollout_is``; ``mode=mask`` is its ``"lo_hi"``
threshold), the rejection its ``compute_rollout_rejection_mask``.

Metrics (``rollout_corr/...``, global over the data-parallel ranks): ``weight_mean`` /
``weight_min`` / ``weight_max`` (applied weights over valid tokens), ``rejected_token_share`` /
``rejected_seq_share`` (valid tokens / non-empty responses that no longer train: weight 0 or
rejected), and the mismatch before and after the correction, ``k1`` (``mean(rollout - old)``,
KL(rollout || train)), ``k3`` (``mean(exp(l) - l - 1)``), ``chi2_token`` (``mean(rho_t^2) - 1``)
and ``chi2_seq`` (``mean over responses of exp(2 sum_t l_t) - 1``), each as ``..._before``
(every valid token) and ``..._after`` (the tokens still training). Conventions that differ from
verl's ``compute_offpolicy_metrics`` on purpose: ``chi2_seq`` averages over non-empty responses
(verl over every row, an empty row adding 0 to ``E[rho^2]`` - 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel_models.rl.algorithms.core import as_bool_mask, masked_mean, masked_sum
from parallel_models.rl.observe import dp_stats

SAFETY_BOUND = 20.0
LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")
REJECTION_STATISTICS = ("seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_mean_k3",
                        "seq_max_k2", "seq_max_k3")
WEIGHTS_KEY = "rollout_is_weights"


@dataclass(frozen=True)
class CorrectionSettings:
    """What the ``actor`` section asks for (``level`` None: no weights, rejection only)."""

    level: str | None
    mode: str = "truncate"
    hi: float = 2.0
    lo: float | None = None
    reject: str | None = None
    reject_threshold: float | None = None


def settings_from_config(actor_cfg) -> CorrectionSettings | None:
    """The correction of the ``actor`` section (``rollout_correction`` or the older
    ``tis_cap``), or None when off."""
    rc = getattr(actor_cfg, "rollout_correction", None)
    cap = getattr(actor_cfg, "tis_cap", None)
    if rc is not None and (rc.level is not None or rc.reject is not None):
        return CorrectionSettings(rc.level, rc.mode, float(rc.hi),
                                  None if rc.lo is None else float(rc.lo), rc.reject,
                                  None if rc.reject_threshold is None else
                                  float(rc.reject_threshold))
    if cap is not None:
        return CorrectionSettings("token", "truncate", float(cap))
    return None


def log_ratio(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
              response_mask: torch.Tensor) -> torch.Tensor:
    """``old - rollout`` on valid tokens, 0 elsewhere (padding garbage never reaches an exp)."""
    m = as_bool_mask(response_mask, old_log_probs)
    diff = old_log_probs.detach() - rollout_log_probs.detach().to(old_log_probs.dtype)
    return torch.where(m, diff, torch.zeros((), dtype=diff.dtype, device=diff.device))


def level_log_ratio(lr: torch.Tensor, response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """The log importance ratio of each token at ``level`` (``[B, R]``, unclamped)."""
    if level == "token":
        return lr
    m = as_bool_mask(response_mask, lr)
    if level == "sequence":
        return masked_sum(lr, m, dim=-1, keepdim=True).expand_as(lr)
    if level == "geometric":
        return masked_mean(lr, m, dim=-1, keepdim=True).expand_as(lr)
    raise ValueError(f"actor.rollout_correction.level={level!r}: expected one of "
                     f"{', '.join(LEVELS)}")


def correction_weights(lr: torch.Tensor, response_mask: torch.Tensor, level: str,
                       mode: str = "truncate", hi: float = 2.0, lo: float | None = None
                       ) -> torch.Tensor:
    """Importance weights ``[B, R]`` (0 on padding, no gradient) from the log ratio ``lr``."""
    m = as_bool_mask(response_mask, lr)
    zero = torch.zeros((), dtype=lr.dtype, device=lr.device)
    raw = torch.exp(torch.clamp(level_log_ratio(lr, m, level), -SAFETY_BOUND, SAFETY_BOUND))
    raw = torch.where(m, raw, zero)
    if mode == "truncate":
        w = raw.clamp(max=hi)
    elif mode == "mask":
        low = 1.0 / hi if lo is None else lo
        w = torch.where((raw >= low) & (raw <= hi), raw, zero)
    else:
        raise ValueError(f"actor.rollout_correction.mode={mode!r}: expected one of "
                         f"{', '.join(MODES)}")
    return w.detach()


def rejection_statistic(lr: torch.Tensor, response_mask: torch.Tensor, name: str) -> torch.Tensor:
    """Per-response mismatch statistic ``[B]`` of ``name`` (``seq_{sum,mean,max}_k{2,3}``; 0
    for an empty response)."""
    if name not in REJECTION_STATISTICS:
        raise ValueError(f"actor.rollout_correction.reject={name!r}: expected one of "
                         f"{', '.join(REJECTION_STATISTICS)}")
    m = as_bool_mask(response_mask, lr)
    safe = torch.clamp(lr, -SAFETY_BOUND, SAFETY_BOUND)
    per_token = 0.5 * safe ** 2 if name.endswith("k2") else torch.exp(safe) - 1.0 - safe
    if name.startswith("seq_sum"):
        return masked_sum(per_token, m, dim=-1)
    if name.startswith("seq_mean"):
        return masked_mean(per_token, m, dim=-1)
    low = torch.full((), float("-inf"), dtype=per_token.dtype, device=per_token.device)
    top = torch.where(m, per_token, low).max(dim=-1).values
    return torch.where(m.any(dim=-1), top, torch.zeros_like(top))


def mismatch_metrics(lr: torch.Tensor, mask: torch.Tensor, suffix: str) -> dict[str, float]:
    """k1, k3, chi2_token, chi2_seq of the log ratio over ``mask``, global over DP ranks."""
    m = as_bool_mask(mask, lr)
    rows = m.any(dim=-1)
    rho = torch.exp(torch.clamp(lr, -SAFETY_BOUND, SAFETY_BOUND))
    seq = torch.exp(2.0 * torch.clamp(masked_sum(lr, m, dim=-1), -SAFETY_BOUND, SAFETY_BOUND))
    return {f"rollout_corr/k1_{suffix}": dp_stats.masked_mean(-lr, m),
            f"rollout_corr/k3_{suffix}": dp_stats.masked_mean(torch.exp(lr) - lr - 1.0, m),
            f"rollout_corr/chi2_token_{suffix}": dp_stats.masked_mean(rho.square(), m) - 1.0,
            f"rollout_corr/chi2_seq_{suffix}": dp_stats.masked_mean(seq, rows) - 1.0}


def correct(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
            response_mask: torch.Tensor, settings: CorrectionSettings
            ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """``(weights or None, response mask after rejection, metrics)`` of one batch."""
    m = as_bool_mask(response_mask, old_log_probs)
    lr = log_ratio(old_log_probs, rollout_log_probs, m)  # the inputs' dtype, as verl
    weights = None
    training = m
    if settings.level is not None:
        weights = correction_weights(lr, m, settings.level, settings.mode, settings.hi,
                                     settings.lo)
        training = training & (weights > 0)
    new_mask = response_mask
    if settings.reject is not None:
        stat = rejection_statistic(lr, m, settings.reject)
        keep = (stat <= settings.reject_threshold).unsqueeze(-1)
        new_mask = response_mask * keep.to(response_mask.dtype)
        training = training & keep
    rows = m.any(dim=-1)
    metrics = {"rollout_corr/rejected_token_share": dp_stats.masked_mean((~training).double(), m),
               "rollout_corr/rejected_seq_share": dp_stats.masked_mean(
                   (~training.any(dim=-1)).double(), rows)}
    if weights is not None:
        big = torch.full((), float("inf"), dtype=weights.dtype, device=weights.device)
        metrics.update({"rollout_corr/weight_mean": dp_stats.masked_mean(weights, m),
                        "rollout_corr/weight_max": dp_stats.data_parallel_max(
                            torch.where(m, weights, -big)),
                        "rollout_corr/weight_min": -dp_stats.data_parallel_max(
                            torch.where(m, -weights, -big))})
    metrics.update(mismatch_metrics(lr, m, "before"))
    metrics.update(mismatch_metrics(lr, training, "after"))
    return weights, new_mask, metrics


def apply_rollout_correction(batch, actor_cfg) -> tuple[dict[str, float], torch.Tensor | None]:
    """Put the weights of ``actor_cfg``'s correction into ``batch`` (``rollout_is_weights``);
    returns its metrics ({} when off) and the response mask with the rejected responses zeroed
    (None without rejection), which the trainer sets after the advantages (a rejected response
    still counts in its group's baseline, as in verl, whose group estimators read the rewards,
    not the mask)."""
    settings = settings_from_config(actor_cfg)
    if settings is None:
        return {}, None
    rollout = batch.get("rollout_log_probs")
    if rollout is None:
        key = "actor.tis_cap" if getattr(actor_cfg, "tis_cap", None) is not None else \
            "actor.rollout_correction"
        raise ValueError(f"{key} is set but the batch has no rollout log-probs (the rollout "
                         "backend did not return the sampler's log-probs)")
    old = batch["old_log_probs"]
    weights, mask, metrics = correct(old, rollout.to(old.device), batch["response_mask"],
                                     settings)
    if weights is not None:
        batch[WEIGHTS_KEY] = weights
    return metrics, (mask if settings.reject is not None else None)


__all__ = ["CorrectionSettings", "settings_from_config", "log_ratio", "level_log_ratio",
           "correction_weights", "rejection_statistic", "mismatch_metrics", "correct",
           "apply_rollout_correction", "LEVELS", "MODES", "REJECTION_STATISTICS", "WEIGHTS_KEY"]
