"""PPO / RLHF algorithm core: advantages, KL penalties, and losses (pure torch).

Everything here is single-process math on padded ``(batch, response_len)``
tensors. Parallelism (data-parallel reductions, vocab-parallel logits, micro-batch
loss scaling) belongs to the callers; nothing in this file talks to
``torch.distributed``.

Conventions
-----------
* ``response_mask`` is a 0/1 float or bool tensor with 1 on valid response
  tokens. It is treated as *binary*: any value > 0 counts as valid. Masks may
  have holes (e.g. tool-output tokens inside a multi-turn response) and rows may
  be entirely empty (padding rows added to even out micro-batches).
* Masked positions are selected with ``torch.where`` rather than multiplied by the
  mask, so garbage in padding (``-inf`` log-probs, NaN values) can neither leak
  into a result nor into a gradient (``0 * inf`` is NaN, ``where`` is not).
* Tensors returned per token are zero at masked positions.
* Loss functions return ``(loss, metrics)``; metric values are detached 0-dim
  tensors so that the hot path does not force a device sync. Only
  :func:`apply_kl_penalty`, which must feed a Python float to the KL
  controller anyway, returns floats.

The formulas follow the usual references (Schulman et al. 2017 for PPO and GAE,
Ye et al. 2020 for dual clip, Ziegler et al. 2019 for the adaptive KL
controller, Shao et al. 2024 for GRPO, Ahmadian et al. 2024 for RLOO, Schulman's
"Approximating KL divergence" note for the k1/k2/k3 estimators), with verl's
``core_algos.py`` conventions where those leave a choice open.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from parallel_models.rl.registry import Registry

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "scores_at_last_token",
    "compute_gae",
    "compute_returns",
    "compute_grpo_advantages",
    "compute_rloo_advantages",
    "KL_PENALTY_KINDS",
    "KL_ESTIMATORS",
    "kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "apply_kl_penalty",
]

# Added to the variance before rsqrt when whitening: keeps a constant batch finite.
WHITEN_EPS = 1e-8


# ---------------------------------------------------------------------------
# Masked reductions
# ---------------------------------------------------------------------------


def as_bool_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Mask as bool, broadcast to ``like``'s shape (counts must see every element)."""
    m = mask if mask.dtype == torch.bool else mask > 0
    return m.expand_as(like)


def masked_sum(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False
) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is set (masked entries may be NaN/inf)."""
    m = as_bool_mask(mask, x)
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(dim=dim, keepdim=keepdim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False
) -> torch.Tensor:
    """Mean of ``x`` over valid positions; 0 (not NaN) where nothing is valid."""
    m = as_bool_mask(mask, x)
    total = masked_sum(x, m, dim=dim, keepdim=keepdim)
    count = m.sum(dim=dim, keepdim=keepdim).to(total.dtype)
    # clamp_min(1) keeps the division finite; for an empty slice total is exactly 0.
    return total / count.clamp_min(1)


def masked_var(
    x: torch.Tensor,
    mask: torch.Tensor,
    unbiased: bool = True,
    dim: int | tuple[int, ...] | None = None,
    keepdim: bool = False,
) -> torch.Tensor:
    """Variance of ``x`` over valid positions.

    With ``unbiased`` the Bessel correction n/(n-1) is applied (like ``torch.var``).
    Where fewer than two (unbiased) or zero (biased) positions are valid the spread
    is not measurable and 0 is returned instead of raising, so this never needs a
    host sync to check counts.
    """
    m = as_bool_mask(mask, x)
    mean = masked_mean(x, m, dim=dim, keepdim=True)
    sq = masked_sum((x - mean) ** 2, m, dim=dim, keepdim=keepdim)
    count = m.sum(dim=dim, keepdim=keepdim).to(sq.dtype)
    denom = count - 1 if unbiased else count
    return torch.where(denom > 0, sq / denom.clamp_min(1), torch.zeros_like(sq))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalize ``x`` to unit variance (and zero mean if ``shift_mean``) over all valid positions.

    Statistics are global over the whole tensor (batch-level whitening, as PPO
    implementations do for advantages). ``shift_mean=False`` restores the mean so
    that only the scale changes (used by some implementations for rewards, whose
    sign carries meaning). Masked positions are returned as 0; an all-empty mask
    gives all zeros.
    """
    m = as_bool_mask(mask, x)
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, torch.zeros_like(whitened))


# ---------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------


def scores_at_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token-level rewards: each response's scalar score on its *last valid* response token.

    ``scores`` is ``(batch,)``, ``response_mask`` ``(batch, response_len)`` and may have holes
    (the last valid token is the last set position, not ``count - 1``). Empty rows get no
    reward. Returns float32 zeros elsewhere, on the mask's device.
    """
    m = response_mask if response_mask.dtype == torch.bool else response_mask > 0
    if scores.shape != m.shape[:1]:
        raise ValueError(f"scores has shape {tuple(scores.shape)}, expected ({m.shape[0]},) "
                         f"(one per row of response_mask {tuple(m.shape)})")
    out = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
    positions = torch.arange(m.shape[-1], device=m.device).expand_as(m)
    last = torch.where(m, positions, -1).amax(dim=-1) if m.shape[-1] else \
        torch.full(m.shape[:1], -1, device=m.device)
    has = last >= 0
    rows = torch.arange(m.shape[0], device=m.device)[has]
    out[rows, last[has]] = scores.to(device=m.device, dtype=torch.float32)[has]
    return out


@torch.no_grad()
def compute_gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation over the valid tokens of each response.

    Returns ``(advantages, returns)``, both ``(batch, response_len)``:
    ``returns`` are the raw lambda-returns (unwhitened advantages + values, the
    critic's regression target) and ``advantages`` are the same advantages,
    whitened over the mask of this tensor when ``whiten`` (with ``whiten=False``
    they are the raw GAE, ``returns - values``; a data-parallel caller whitens
    them with global statistics instead). Both are 0 at masked positions.

    Masked positions are skipped, not treated as episode ends: at a hole the next
    value and the running advantage pass through unchanged, so a response with
    holes gets exactly the GAE of the response with the holes cut out (the
    rewards and values at holes are ignored). This matches verl's
    ``nextvalues = values*mask + (1-mask)*nextvalues`` recursion. After the last
    valid token the bootstrap value is 0 (the response is a finished episode).

    The time loop is sequential by nature; it costs a few small kernels per
    token and runs without autograd.
    """
    m = as_bool_mask(response_mask, values)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    rewards = torch.where(m, token_level_rewards.to(values.dtype), zero)
    vals = torch.where(m, values, zero)

    batch, length = vals.shape
    next_values = vals.new_zeros(batch)
    last_gae = vals.new_zeros(batch)
    advantages_reversed = []
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_values - vals[:, t]
        gae = delta + gamma * lam * last_gae
        valid = m[:, t]
        next_values = torch.where(valid, vals[:, t], next_values)
        last_gae = torch.where(valid, gae, last_gae)
        advantages_reversed.append(last_gae)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)

    returns = torch.where(m, advantages + vals, zero)
    advantages = torch.where(m, advantages, zero)
    if whiten:
        advantages = masked_whiten(advantages, m)
    return advantages, returns


@torch.no_grad()
def compute_returns(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """Discounted reward-to-go ``G_t = r_t + gamma * G_{t+1}`` over valid tokens.

    Holes are skipped the same way :func:`compute_gae` skips them (the running
    return passes through a masked position undiscounted, its reward is
    ignored), so this equals GAE's ``returns`` with ``lam=1`` and zero values.
    Used by critic-free estimators (REINFORCE, REINFORCE++). Masked positions are 0.
    """
    m = as_bool_mask(response_mask, token_level_rewards)
    zero = torch.zeros((), dtype=token_level_rewards.dtype, device=token_level_rewards.device)
    rewards = torch.where(m, token_level_rewards, zero)
    running = rewards.new_zeros(rewards.shape[0])
    out = []
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(m[:, t], rewards[:, t] + gamma * running, running)
        out.append(running)
    returns = torch.stack(out[::-1], dim=1)
    return torch.where(m, returns, zero)


def _group_inverse(group_index: torch.Tensor | Sequence[Any], device: torch.device) -> torch.Tensor:
    """Map arbitrary group labels (ints, or any hashables such as prompt uids) to 0..G-1."""
    if isinstance(group_index, torch.Tensor):
        if group_index.dim() != 1:
            raise ValueError(f"group_index must be 1-D, got shape {tuple(group_index.shape)}")
        _, inverse = torch.unique(group_index.to(device), return_inverse=True)
        return inverse
    ids: dict[Any, int] = {}
    inverse = [ids.setdefault(g, len(ids)) for g in group_index]
    return torch.tensor(inverse, dtype=torch.long, device=device)


def _group_stats(
    scores: torch.Tensor, group_index: torch.Tensor | Sequence[Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, group sum, group mean and unbiased group std (all gathered back to (batch,))."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D (one scalar per response), got shape {tuple(scores.shape)}")
    inverse = _group_inverse(group_index, scores.device)
    if inverse.shape[0] != scores.shape[0]:
        raise ValueError(f"group_index has {inverse.shape[0]} entries, scores has {scores.shape[0]}")
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, inverse, torch.ones_like(scores)
    )
    total = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, scores)
    mean = total / count.clamp_min(1)
    # Two-pass variance (deviations from the group mean) for accuracy.
    dev = scores - mean[inverse]
    sq = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, dev * dev)
    std = torch.sqrt(sq / (count - 1).clamp_min(1))
    return count[inverse], total[inverse], mean[inverse], std[inverse]


def _to_token_level(adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-sequence advantage to every valid token of its response."""
    m = response_mask if response_mask.dtype == torch.bool else response_mask > 0
    return torch.where(m, adv.unsqueeze(-1), torch.zeros((), dtype=adv.dtype, device=adv.device))


@torch.no_grad()
def compute_grpo_advantages(
    scores: torch.Tensor,
    group_index: torch.Tensor | Sequence[Any],
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO outcome advantages: each response's score relative to its group.

    ``scores`` is one scalar per response; ``group_index`` labels responses to the
    same prompt (any ints, not necessarily contiguous or sorted; a list of
    hashables such as uid strings also works). The advantage is
    ``(score - group_mean) / (group_std + eps)`` with the unbiased std of
    ``torch.std``, or just ``score - group_mean`` when ``norm_by_std`` is False
    (Dr. GRPO). A group of one has no baseline to compare against and gets 0
    advantage (no learning signal), rather than its raw score. The value is
    broadcast to every valid token, 0 elsewhere.
    """
    count, _, mean, std = _group_stats(scores, group_index)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    return _to_token_level(adv, response_mask)


@torch.no_grad()
def compute_rloo_advantages(
    scores: torch.Tensor, group_index: torch.Tensor | Sequence[Any], response_mask: torch.Tensor
) -> torch.Tensor:
    """RLOO advantages: score minus the mean score of the *other* responses in its group.

    The leave-one-out baseline keeps the estimator unbiased (the baseline does not
    depend on the sample itself). A group of one has no others and gets 0. The
    value is broadcast to every valid token, 0 elsewhere.
    """
    count, total, _, _ = _group_stats(scores, group_index)
    others_mean = (total - scores) / (count - 1).clamp_min(1)
    adv = torch.where(count > 1, scores - others_mean, torch.zeros_like(scores))
    return _to_token_level(adv, response_mask)


# ---------------------------------------------------------------------------
# KL penalty
# ---------------------------------------------------------------------------

# Every KL estimator is called ``fn(log_probs, ref_log_probs) -> per-token KL`` (same shape, no
# masking: callers mask). ``algorithm.kl_penalty`` and ``actor.kl_loss_type`` name one: a
# registered name below or the user's own ``path/to/file.py:function``.
KL_ESTIMATORS = Registry("KL estimator", params=("log_probs", "ref_log_probs"))


@KL_ESTIMATORS.register("k1")
def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``logp - ref``; unbiased, high variance, can be negative per token."""
    return log_probs - ref_log_probs


@KL_ESTIMATORS.register("abs")
def kl_abs(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``|logp - ref|``."""
    return (log_probs - ref_log_probs).abs()


@KL_ESTIMATORS.register("k2", "mse")
def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``0.5 * (logp - ref)^2``; low variance, biased."""
    return 0.5 * (log_probs - ref_log_probs).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``exp(ref - logp) - (ref - logp) - 1``; unbiased, always >= 0, low variance. Clamped to
    [-10, 10] like verl because the exp explodes when the policy drifts far from the reference."""
    log_ratio = ref_log_probs - log_probs
    # Clamping the exponent changes no value after the outer clamp (k3 is
    # monotone in |log_ratio| and already > 10 at |log_ratio| = 20), but it
    # keeps exp finite so the backward pass never computes 0 * inf = NaN.
    log_ratio = torch.clamp(log_ratio, min=-20.0, max=20.0)
    kld = torch.exp(log_ratio) - log_ratio - 1
    return torch.clamp(kld, min=-10.0, max=10.0)


KL_PENALTY_KINDS = ("k1", "abs", "k2", "mse", "k3", "low_var_kl")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs by the KL estimator
    ``kind`` (a name of :data:`KL_ESTIMATORS`: ``k1``, ``abs``, ``k2`` / ``mse``, ``k3`` /
    ``low_var_kl``, or a user's ``path/to/file.py:function``); unknown kinds raise
    :class:`~parallel_models.errors.ConfigError` (a ValueError).

    No masking is applied here; callers mask the result.
    """
    return KL_ESTIMATORS.get(kind)(log_probs=logprob, ref_log_probs=ref_logprob)


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op so both controllers share one interface."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019), "Fine-Tuning LMs from Human Preferences".

    Proportional control of the coefficient towards ``target_kl``: the error is
    clipped to +-20% so a single noisy batch cannot swing the coefficient, and the
    step is scaled by ``n_steps / horizon`` so the adaptation speed is set in
    samples rather than in calls.

    Convention (verl's): ``current_kl`` and ``target_kl`` are *per-token* KLs, the
    mean over responses of each response's token-mean KL (``current_kl`` of
    :func:`apply_kl_penalty`), and ``n_steps`` is the number of responses of the
    batch. A target like 0.1 therefore means the same for short and long
    responses (a summed, per-sequence KL grows with length and would push the
    coefficient up without bound).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        mult = 1.0 + proportional_error * n_steps / self.horizon
        self.value *= mult


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kind: str = "k1",
    update_kl_ctrl: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Fold a per-token KL penalty into the rewards: ``r_t = score_t - beta * kl_t``.

    ``beta`` is ``kl_ctrl.value`` *before* this call's update. Masked positions of
    the returned rewards are 0.

    Metrics (Python floats):

    * ``current_kl``: verl's ``reward_kl_penalty``: each response's token-mean KL,
      then the mean over all rows of the batch (an empty row counts as 0, as in
      verl). This is the value fed to ``kl_ctrl.update`` with ``n_steps`` = number
      of rows, in the per-token convention of :class:`AdaptiveKLController`.
    * ``token_kl``: the same number, under the name the trainer has always logged.
    * ``seq_kl``: mean over non-empty responses of each response's *summed* KL
      (the sequence-level KL of Ziegler et al.), for reference only.
    * ``kl_coef``: the ``beta`` used.

    With data parallelism, pass ``update_kl_ctrl=False`` and update the controller
    with a globally reduced KL instead, so every rank keeps the same coefficient.
    """
    m = as_bool_mask(response_mask, token_level_scores)
    kld = kl_penalty(logprob, ref_logprob, kind)
    kld = torch.where(m, kld, torch.zeros_like(kld))
    beta = kl_ctrl.value
    rewards = torch.where(m, token_level_scores - beta * kld, torch.zeros_like(token_level_scores))

    current_kl = float(masked_mean(kld, m, dim=-1).mean().item()) if kld.shape[0] else 0.0
    nonempty = m.any(dim=-1)
    metrics = {
        "current_kl": current_kl,
        "token_kl": current_kl,
        "seq_kl": float(masked_mean(kld.sum(dim=-1), nonempty).item()),
        "kl_coef": float(beta),
    }
    if update_kl_ctrl:
        kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return rewards, metrics
