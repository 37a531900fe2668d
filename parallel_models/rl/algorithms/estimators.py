"""Advantage estimators by name (``algorithm.adv_estimator``): the built-in ``gae``, ``grpo``,
``rloo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``remax``, ``opo`` and
``gpg`` (docs/ALGORITHMS.md: formulas and papers), a user's own from
``path/to/file.py:function``, and :func:`needs_critic`, the one answer to "does this run have a
critic" that the config checks, both backends and the advantage phase use.

The call signature of an estimator (called with keywords)::

    fn(token_level_rewards, response_mask, values, group_index, config) -> (advantages, returns)

* ``token_level_rewards``: ``[B, R]`` float, each response's score on its last valid token
  minus the in-reward KL penalty (``algorithm.kl_in_reward``) on every token;
* ``response_mask``: ``[B, R]``, 1 on valid response tokens;
* ``values``: ``[B, R]`` the critic's values, or None when the estimator needs no critic;
* ``group_index``: ``[B]`` long, rows with the same index are samples of one prompt (the
  ``rollout.n`` samples of a prompt are on the same rank);
* ``config``: the ``algorithm`` config section (``gamma``, ``lam``, ...);
* returns ``advantages`` and ``returns``, ``[B, R]``, 0 on masked positions; the critic (if any)
  is trained on ``returns``. ``algorithm.whiten_advantages`` whitens the advantages afterwards.

What an estimator declares (registration arguments of a built-in, function attributes of a
user's function, e.g. ``fn.needs_critic = True``):

* ``needs_critic`` (default False): the run builds and trains a critic, ``values`` is given;
* ``needs_groups`` (default False): it compares the samples of a prompt (``rollout.n >= 2``);
* ``whiten_by_default`` (default False): ``algorithm.whiten_advantages: null`` whitens;
* ``needs_greedy_baseline`` (default False): the trainer rolls out one greedy response per prompt,
  scores it with the reward, and the estimator gets the keyword ``reward_baselines``, ``[B]``
  float, each row's prompt's greedy score (ReMax); give that parameter a default (``=None``),
  the signature check calls with the common keywords only.

Groups of one (a prompt with a single sample) get advantage 0 from every group estimator here:
there is no baseline to compare with. verl instead uses a baseline of 0 there (the advantage is
the raw score); tests/rl/test_algorithms_vs_verl.py checks both sides of that convention.
"""

from __future__ import annotations

import torch

from parallel_models.rl.algorithms import core as algos
from parallel_models.rl.observe import dp_stats
from parallel_models.rl.registry import Registry

ADVANTAGE_ESTIMATORS = Registry(
    "advantage estimator",
    params=("token_level_rewards", "response_mask", "values", "group_index", "config"),
    defaults={"needs_critic": False, "needs_groups": False, "whiten_by_default": False,
              "needs_greedy_baseline": False})


@ADVANTAGE_ESTIMATORS.register("gae", needs_critic=True, whiten_by_default=True)
def gae(token_level_rewards, response_mask, values, group_index, config):
    """Generalized advantage estimation (``config.gamma``, ``config.lam``) on the critic's
    values; the returns are ``advantages + values``."""
    del group_index
    return algos.compute_gae(token_level_rewards, values, response_mask, config.gamma,
                             config.lam, whiten=False)


@ADVANTAGE_ESTIMATORS.register("grpo", needs_groups=True)
def grpo(token_level_rewards, response_mask, values, group_index, config):
    """GRPO (Shao et al. 2024, arXiv:2402.03300): each response's summed reward against its
    group's mean, divided by the group's std (``(R - mean) / (std + 1e-6)``); with
    ``config.norm_adv_by_std`` false only ``R - mean`` (Dr. GRPO, Liu et al. 2025,
    arXiv:2503.20783, with ``actor.loss_agg_mode: seq-mean-token-sum-norm``); returns =
    advantages."""
    del values
    seq_scores = algos.masked_sum(token_level_rewards, response_mask, dim=-1)
    adv = algos.compute_grpo_advantages(seq_scores, group_index, response_mask,
                                        norm_by_std=getattr(config, "norm_adv_by_std", True))
    return adv, adv.clone()


@ADVANTAGE_ESTIMATORS.register("rloo", needs_groups=True)
def rloo(token_level_rewards, response_mask, values, group_index, config):
    """RLOO: each response's summed reward minus the mean of the other samples of its prompt;
    returns = advantages."""
    del values, config
    seq_scores = algos.masked_sum(token_level_rewards, response_mask, dim=-1)
    adv = algos.compute_rloo_advantages(seq_scores, group_index, response_mask)
    return adv, adv.clone()


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus", whiten_by_default=True)
def reinforce_plus_plus(token_level_rewards, response_mask, values, group_index, config):
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): the discounted reward-to-go
    ``G_t = r_t + gamma * G_{t+1}`` (``config.gamma``; masked positions skipped) as returns and
    advantages; the whitening over the global batch that completes it is the advantage phase's
    (``whiten_by_default``: ``algorithm.whiten_advantages: null`` whitens, false gives plain
    REINFORCE with the token-level KL reward)."""
    del values, group_index
    returns = algos.compute_returns(token_level_rewards, response_mask, gamma=config.gamma)
    return returns.clone(), returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline", needs_groups=True,
                               whiten_by_default=True)
def reinforce_plus_plus_baseline(token_level_rewards, response_mask, values, group_index,
                                 config):
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): each response's summed reward minus
    its group's mean, on every token, then (``whiten_by_default``) whitened over the global
    batch; returns = advantages (before the whitening)."""
    del values, config
    seq_scores = algos.masked_sum(token_level_rewards, response_mask, dim=-1)
    adv = algos.compute_grpo_advantages(seq_scores, group_index, response_mask,
                                        norm_by_std=False)
    return adv, adv.clone()


@ADVANTAGE_ESTIMATORS.register("remax", needs_greedy_baseline=True)
def remax(token_level_rewards, response_mask, values, group_index, config,
          reward_baselines=None):
    """ReMax (Li et al. 2023, arXiv:2310.10505): REINFORCE with the reward of the greedy
    response to the same prompt as baseline: ``A_t = sum_{s >= t} r_s - R(greedy)`` (no
    discount); returns are the reward-to-go. ``reward_baselines`` ``[B]``: the greedy
    response's score for each row (the trainer rolls it out: ``needs_greedy_baseline``)."""
    del values, group_index, config
    if reward_baselines is None:
        raise ValueError("the remax estimator needs reward_baselines (the greedy responses' "
                         "scores, rolled out by the trainer)")
    m = algos.as_bool_mask(response_mask, token_level_rewards)
    returns = algos.compute_returns(token_level_rewards, m, gamma=1.0)
    base = reward_baselines.to(device=returns.device, dtype=returns.dtype).unsqueeze(-1)
    adv = torch.where(m, returns - base, torch.zeros_like(returns))
    return adv, returns


@ADVANTAGE_ESTIMATORS.register("opo", needs_groups=True)
def opo(token_level_rewards, response_mask, values, group_index, config):
    """OPO, On-Policy RL with Optimal reward baseline (Hao et al. 2025, arXiv:2505.23585): each
    response's summed reward minus its group's length-weighted mean reward
    ``b = sum_j |y_j| R_j / sum_j |y_j|`` (the variance-minimizing baseline for sequence
    rewards); returns = advantages."""
    del values, config
    m = algos.as_bool_mask(response_mask, token_level_rewards)
    seq_scores = algos.masked_sum(token_level_rewards, m, dim=-1)
    lengths = m.sum(dim=-1).to(seq_scores.dtype)
    count, weighted, _, _ = algos._group_stats(seq_scores * lengths, group_index)
    _, total_len, _, _ = algos._group_stats(lengths, group_index)
    baseline = weighted / total_len.clamp_min(1)
    adv = torch.where(count > 1, seq_scores - baseline, torch.zeros_like(seq_scores))
    adv = algos._to_token_level(adv, m)
    return adv, adv.clone()


@ADVANTAGE_ESTIMATORS.register("gpg", needs_groups=True)
def gpg(token_level_rewards, response_mask, values, group_index, config):
    """GPG, Group Policy Gradient (Chu et al. 2025, arXiv:2504.02546): each response's summed
    reward minus its group's mean, scaled by ``alpha = B / #{responses with a nonzero reward}``
    over the global batch (corrects the gradient for groups without signal; ``f_norm = 1``);
    pair it with the ``gpg`` policy loss. Returns = advantages."""
    del values, config
    seq_scores = algos.masked_sum(token_level_rewards, response_mask, dim=-1)
    counts = dp_stats.data_parallel_sum(torch.stack([
        torch.tensor(float(seq_scores.numel()), dtype=torch.float64),
        (seq_scores != 0).sum().to(torch.float64).cpu()]))
    alpha = float(counts[0] / counts[1].clamp_min(1))
    adv = algos.compute_grpo_advantages(seq_scores, group_index, response_mask,
                                        norm_by_std=False)
    return alpha * adv, alpha * adv


def estimator(alg):
    """The advantage estimator ``alg.adv_estimator`` (the ``algorithm`` section) names."""
    return ADVANTAGE_ESTIMATORS.get(alg.adv_estimator)


def declares(alg, attribute: str) -> bool:
    """What the estimator of ``alg`` declares (``needs_critic``, ``needs_groups``,
    ``whiten_by_default``, ``needs_greedy_baseline``)."""
    return bool(ADVANTAGE_ESTIMATORS.attribute(estimator(alg), attribute))


def needs_critic(cfg) -> bool:
    """Whether the run has a critic: its advantage estimator needs one. The config check makes
    ``critic.enable`` agree (null = this answer; true / false must match it)."""
    return declares(cfg.algorithm, "needs_critic")


def run_estimator(alg, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                  values: torch.Tensor | None, group_index: torch.Tensor,
                  reward_baselines: torch.Tensor | None = None):
    """``(advantages, returns)`` from the estimator of ``alg``, checked for shape;
    ``reward_baselines`` go to an estimator that declares ``needs_greedy_baseline``."""
    fn = estimator(alg)
    extra = ({"reward_baselines": reward_baselines}
             if ADVANTAGE_ESTIMATORS.attribute(fn, "needs_greedy_baseline") else {})
    out = fn(token_level_rewards=token_level_rewards, response_mask=response_mask,
             values=values, group_index=group_index, config=alg, **extra)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(f"advantage estimator {alg.adv_estimator!r} returned "
                        f"{type(out).__name__}; expected (advantages, returns)")
    for name, t in zip(("advantages", "returns"), out):
        if not isinstance(t, torch.Tensor) or t.shape != response_mask.shape:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"advantage estimator {alg.adv_estimator!r}: {name} must be a "
                             f"tensor of the response mask's shape {tuple(response_mask.shape)}"
                             f", got {shape}")
    return out[0], out[1]


__all__ = ["ADVANTAGE_ESTIMATORS", "gae", "grpo", "rloo", "reinforce_plus_plus",
           "reinforce_plus_plus_baseline", "remax", "opo", "gpg", "estimator", "declares",
           "needs_critic", "run_estimator"]
