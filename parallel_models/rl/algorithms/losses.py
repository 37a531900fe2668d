"""PPO losses: loss aggregation modes, the clipped policy loss (dual clip), the clipped value
loss and the entropy bonus (pure torch, single process).

Same conventions as :mod:`parallel_models.rl.algorithms.core` (binary masks with holes and empty
rows, ``torch.where`` masking so padding garbage never reaches a result or a gradient).
Scaling a microbatch's loss to a global (all microbatches, all data-parallel ranks) mean is
the caller's job: :func:`agg_denominator` says what each mode divides by.

Policy losses by name (``actor.policy_loss``, default ``vanilla``, alias ``ppo``; the others
in :mod:`parallel_models.rl.algorithms.policy_losses`; docs/ALGORITHMS.md lists them all):
:data:`POLICY_LOSSES`, or a user's own ``path/to/file.py:function``. The call signature
(called with keywords, on one microbatch)::

    fn(log_probs, old_log_probs, advantages, response_mask, config, token_weights)
        -> (loss, metrics)

* ``log_probs``: ``[B, R]`` the policy's log-probs of the sampled tokens (with gradient);
* ``old_log_probs``: ``[B, R]`` the same before this step's updates; ``advantages``: ``[B, R]``;
* ``response_mask``: ``[B, R]``, 1 on valid response tokens;
* ``config``: the ``actor`` config section (``clip_ratio_low``, ``loss_agg_mode``, ...);
* ``token_weights``: ``[B, R]`` per-token weights without gradient (truncated importance
  sampling, ``actor.tis_cap``), or None;
* returns ``loss``, a 0-dim tensor aggregated over the microbatch by ``config.loss_agg_mode``
  (:func:`agg_loss`: the caller weighs microbatches by :func:`agg_denominator`), and
  ``metrics``, 0-dim detached tensors, token means over the microbatch, logged as
  ``actor/<name>`` (token-weighted means over microbatches and ranks). A loss declares the
  names of its metrics (``metrics=`` at registration, ``fn.metrics = (...)`` for a user's
  function; default none) and returns exactly those.
The entropy bonus and the KL loss (``actor.entropy_coef``, ``actor.use_kl_loss``) are added by
the caller for every policy loss.
"""

from __future__ import annotations

import torch

from parallel_models.rl.algorithms.core import as_bool_mask, masked_mean, masked_sum
from parallel_models.rl.registry import Registry

__all__ = [
    "LOSS_AGG_MODES",
    "agg_loss",
    "agg_denominator",
    "compute_policy_loss",
    "POLICY_LOSSES",
    "ppo_policy_loss",
    "aggregate",
    "truncated_is_weights",
    "compute_value_loss",
    "entropy_from_logits",
    "compute_entropy_loss",
]

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")
_SEQUENCE_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _unknown_mode(mode: str) -> ValueError:
    return ValueError(f"unknown loss aggregation mode {mode!r}; expected one of "
                      f"{', '.join(LOSS_AGG_MODES)}")


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str = "token-mean",
             loss_scale_factor: float | None = None) -> torch.Tensor:
    """Reduce a ``(batch, response_len)`` per-token loss to a scalar.

    * ``token-mean``: mean over all valid tokens of the batch (every token weighs
      the same; long responses weigh more).
    * ``token-sum``: sum over all valid tokens (no normalization at all).
    * ``seq-mean-token-sum``: sum over each response's tokens, mean over responses.
    * ``seq-mean-token-mean``: mean over each response's tokens, mean over
      responses (every response weighs the same; the original GRPO recipe).
    * ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` divided by the constant
      ``loss_scale_factor`` (None: the mask's width, verl's default), Dr. GRPO's unbiased
      ``1 / (G * L_max)`` normalization (Liu et al. 2025, arXiv:2503.20783).

    The sequence modes average over responses that have at least one valid token,
    so all-padding rows do not dilute the mean. A fully empty mask gives 0 with a
    finite (zero) gradient. Scaling across micro-batches / data-parallel ranks is
    the caller's job (:func:`agg_denominator`).
    """
    m = as_bool_mask(loss_mask, loss_mat)
    if mode == "token-mean":
        return masked_mean(loss_mat, m)
    if mode == "token-sum":
        return masked_sum(loss_mat, m)
    if mode in _SEQUENCE_MODES:
        if mode == "seq-mean-token-mean":
            seq_losses = masked_mean(loss_mat, m, dim=-1)
        else:
            seq_losses = masked_sum(loss_mat, m, dim=-1)
        loss = masked_mean(seq_losses, m.any(dim=-1))
        if mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    raise _unknown_mode(mode)


def agg_denominator(loss_mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """What :func:`agg_loss` divides by for ``mode``: valid tokens (``token-mean``), non-empty
    responses (the sequence modes) or 1 (``token-sum``). ``agg_loss(...) * agg_denominator(...)``
    summed over microbatches and ranks, divided by the summed denominators, is the global loss:
    the global token / sequence mean, and for ``token-sum`` the mean over microbatches of their
    token sums (one microbatch per rank and step: the sum over the step's tokens divided by the
    data-parallel size; verl multiplies by it instead)."""
    m = loss_mask if loss_mask.dtype == torch.bool else loss_mask > 0
    if mode == "token-mean":
        return m.sum()
    if mode == "token-sum":
        return torch.ones((), dtype=torch.long, device=m.device)
    if mode in _SEQUENCE_MODES:
        return m.any(dim=-1).sum()
    raise _unknown_mode(mode)


def aggregate(loss_mat: torch.Tensor, loss_mask: torch.Tensor, config) -> torch.Tensor:
    """:func:`agg_loss` with the ``actor`` section's ``loss_agg_mode`` and ``loss_scale_factor``
    (what every built-in policy loss aggregates with)."""
    return agg_loss(loss_mat, loss_mask, config.loss_agg_mode,
                    loss_scale_factor=getattr(config, "loss_scale_factor", None))


def compute_policy_loss(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    token_weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate loss with dual clip (PPO: Schulman et al. 2017, arXiv:1707.06347;
    dual clip: Ye et al. 2020, arXiv:1912.09729).

    Per token, with ``ratio = exp(logprob - old_logprob)``::

        clipped = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))
        loss    = min(clipped, -A * clip_ratio_c)   if A < 0   (dual clip)
                  clipped                            otherwise

    Plain PPO clipping does not bound the loss when ``A < 0`` and the ratio is
    large (the ``max`` picks the unclipped, ever-growing term); dual clip (Ye et
    al. 2020) caps it at ``clip_ratio_c * -A``, which stops a few stale tokens
    from dominating the gradient. ``clip_ratio_c=None`` disables it.
    Asymmetric ``clip_ratio_low`` / ``clip_ratio_high`` allow DAPO's clip-higher.

    Metrics (detached): ``pg_clipfrac`` (fraction of valid tokens where the PPO
    clip is active), ``pg_clipfrac_lower`` (fraction where the dual clip is
    active), ``ppo_kl`` (mean of ``old_logprob - logprob``, a k1 estimate of
    KL(pi_old || pi)).

    ``token_weights`` (no gradient, e.g. :func:`truncated_is_weights`) multiply the per-token
    loss before aggregation.
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual clip, got {clip_ratio_c}")
    m = as_bool_mask(response_mask, logprob)
    zero = torch.zeros((), dtype=logprob.dtype, device=logprob.device)
    # Zero the log-ratio and advantage at masked positions *before* the exp, so
    # -inf/NaN padding cannot produce NaN gradients through the masked branch.
    log_ratio = torch.where(m, logprob - old_logprob, zero)
    adv = torch.where(m, advantages.to(logprob.dtype), zero)

    ppo_kl = masked_mean(-log_ratio, m)
    # exp(20) is already far outside any clip range; the clamp only keeps exp finite.
    ratio = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))

    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).to(logprob.dtype), m)

    if clip_ratio_c is not None:
        pg_losses3 = -adv * clip_ratio_c
        negative = adv < 0
        pg_losses = torch.where(negative, torch.minimum(clipped, pg_losses3), clipped)
        pg_clipfrac_lower = masked_mean((negative & (clipped > pg_losses3)).to(logprob.dtype), m)
    else:
        pg_losses = clipped
        pg_clipfrac_lower = torch.zeros((), dtype=logprob.dtype, device=logprob.device)

    if token_weights is not None:
        pg_losses = pg_losses * torch.where(m, token_weights.detach().to(pg_losses.dtype), zero)
    loss = agg_loss(pg_losses, m, loss_agg_mode, loss_scale_factor=loss_scale_factor)
    metrics = {
        "pg_clipfrac": pg_clipfrac.detach(),
        "pg_clipfrac_lower": pg_clipfrac_lower.detach(),
        "ppo_kl": ppo_kl.detach(),
    }
    return loss, metrics


POLICY_LOSSES = Registry(
    "policy loss",
    params=("log_probs", "old_log_probs", "advantages", "response_mask", "config",
            "token_weights"),
    defaults={"metrics": ()})


@POLICY_LOSSES.register("vanilla", "ppo",
                        metrics=("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"))
def ppo_policy_loss(log_probs, old_log_probs, advantages, response_mask, config,
                    token_weights=None):
    """``vanilla`` (alias ``ppo``, the name of older configs): the clipped PPO loss with dual
    clip (:func:`compute_policy_loss`; Schulman et al. 2017, arXiv:1707.06347, Ye et al. 2020,
    arXiv:1912.09729) with the ``actor`` section's ``clip_ratio_low`` / ``clip_ratio_high`` /
    ``clip_ratio_c`` / ``loss_agg_mode`` / ``loss_scale_factor``."""
    return compute_policy_loss(old_log_probs, log_probs, advantages, response_mask,
                               clip_ratio_low=config.clip_ratio_low,
                               clip_ratio_high=config.clip_ratio_high,
                               clip_ratio_c=config.clip_ratio_c,
                               loss_agg_mode=config.loss_agg_mode, token_weights=token_weights,
                               loss_scale_factor=getattr(config, "loss_scale_factor", None))


# The other built-in policy losses live in policy_losses.py, imported on first use.
for _name in ("gspo", "geo_mean", "cispo", "clip_cov", "kl_cov", "gpg"):
    POLICY_LOSSES.add(_name, f"parallel_models.rl.algorithms.policy_losses:{_name}_policy_loss")


def compute_value_loss(
    vpreds: torch.Tensor,
    values_old: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)``.

    The pessimistic max keeps the critic from moving further than ``c`` from the
    rollout values in the direction that would look like an improvement (PPO2's
    value clipping). ``cliprange_value=None`` gives the plain squared error.
    Metrics (detached): ``vf_clipfrac`` (fraction of valid tokens where the
    clipped term is the larger one).
    """
    m = as_bool_mask(response_mask, vpreds)
    zero = torch.zeros((), dtype=vpreds.dtype, device=vpreds.device)
    v = torch.where(m, vpreds, zero)
    v_old = torch.where(m, values_old.to(vpreds.dtype), zero)
    ret = torch.where(m, returns.to(vpreds.dtype), zero)

    vf_losses1 = (v - ret).square()
    if cliprange_value is None:
        vf_losses = vf_losses1
        vf_clipfrac = torch.zeros((), dtype=vpreds.dtype, device=vpreds.device)
    else:
        v_clipped = torch.clamp(v, v_old - cliprange_value, v_old + cliprange_value)
        vf_losses2 = (v_clipped - ret).square()
        vf_losses = torch.maximum(vf_losses1, vf_losses2)
        vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).to(vpreds.dtype), m)

    loss = 0.5 * agg_loss(vf_losses, m, loss_agg_mode)
    return loss, {"vf_clipfrac": vf_clipfrac.detach()}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last (vocab) dimension.

    Computed as ``-sum(p * log p)`` with ``log p = logits - logsumexp(logits)``,
    which never exponentiates a large logit. Half-precision logits are upcast to
    float32 (the result is float32) because bf16 softmax sums lose most of their
    digits over a 100k+ vocabulary. ``-inf`` logits (banned tokens) contribute 0
    and get zero gradient instead of NaN.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    p = torch.exp(logp)
    # p * logp is 0 * -inf = NaN for banned tokens; select 0 there before the product.
    finite = torch.isfinite(logp)
    logp_safe = torch.where(finite, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    return -(p * logp_safe).sum(dim=-1)


def compute_entropy_loss(entropy: torch.Tensor, response_mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Aggregate per-token entropy with :func:`agg_loss`.

    Returns the mean entropy (a bonus, positive); the actor loss is
    ``pg_loss - entropy_coeff * compute_entropy_loss(...)``.
    """
    return agg_loss(entropy, response_mask, mode)


def truncated_is_weights(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, cap: float
                         ) -> torch.Tensor:
    """Truncated importance sampling (verl's ``tis_imp_ratio_cap``, Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"): per token
    ``min(exp(old_logprob - rollout_logprob), cap)``, no gradient. ``old_logprob`` is the
    training engine's log-prob of the sampled token, ``rollout_logprob`` the sampler's, both at
    the rollout temperature."""
    log_ratio = torch.clamp(old_logprob.detach() - rollout_logprob.detach(), min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_ratio), max=cap)
