"""The advantage phase of a PPO step: token-level rewards (score on the last valid response
token, minus the in-reward KL penalty), then advantages and returns by the configured
estimator (``algorithm.adv_estimator``: a name of
:data:`~parallel_models.rl.algorithms.estimators.ADVANTAGE_ESTIMATORS` or a user's
``file.py:function``; signature there), then (``algorithm.whiten_advantages``) whitening over the global batch.

``algorithm.whiten_advantages`` means the same for every estimator: the final advantages are
whitened (zero mean, unit variance over the valid tokens of all data-parallel ranks) when it
is on, and left as the estimator made them when it is off:

* ``gae``: off gives the raw GAE (``returns - values``); the critic's target ``returns`` is
  the same either way.
* ``grpo``: its own per-group normalization (``score - group mean``, divided by the group's
  std; verl's ``norm_adv_by_std_in_grpo``) is part of the estimator and always applied; the
  flag adds batch whitening on top.
* ``rloo``: the leave-one-out baseline is the estimator; the flag adds batch whitening.
* ``reinforce_plus_plus`` / ``reinforce_plus_plus_baseline``: the batch whitening *is* the last
  step of the method (on by default); off leaves the raw (group-centered) returns.
* ``remax``: the greedy response's reward is the baseline (``batch["reward_baselines"]``, one
  per row, rolled out by the trainer; logged as ``reward/greedy_baseline_mean``).

Unset (``null``, the default) it takes each estimator's usual setting (its
``whiten_by_default``), verl's: on for gae, off for grpo and rloo (their group baseline already
centers the advantages), on for the REINFORCE++ pair; off for a user's estimator unless it
declares otherwise.

For grpo / rloo the returns equal the (unwhitened) advantages; they are logged, not trained on.
Groups never straddle data-parallel ranks: the trainer deals prompts to ranks before it
repeats each ``rollout.n`` times, so the group statistics are complete on every rank.
"""

from __future__ import annotations

import torch

from parallel_models.rl.algorithms import core as algos
from parallel_models.rl.algorithms import estimators
from parallel_models.rl.observe import dp_stats
from parallel_models.rl.data.batch import RolloutBatch


def whitens(alg) -> bool:
    """``algorithm.whiten_advantages``, or the estimator's default when it is unset."""
    if alg.whiten_advantages is None:
        return estimators.declares(alg, "whiten_by_default")
    return bool(alg.whiten_advantages)


def compute_advantages(batch: RolloutBatch, alg, kl_ctrl) -> dict[str, float]:
    """Fill ``token_level_rewards``, ``advantages`` and ``returns`` of ``batch`` from its
    ``scores`` (and ``old_log_probs`` / ``ref_log_probs`` with ``alg.kl_in_reward``,
    ``values`` when the estimator needs a critic). ``alg`` is the ``algorithm`` config section;
    ``kl_ctrl`` the KL controller (read here, updated by the caller with ``kl/current_kl``).
    Returns metrics, global over data-parallel ranks."""
    mask = batch.response_mask
    metrics: dict[str, float] = {}
    token_scores = algos.scores_at_last_token(batch["scores"], mask)
    if alg.kl_in_reward:
        rewards, _ = algos.apply_kl_penalty(token_scores, batch["old_log_probs"],
                                            batch["ref_log_probs"], mask, kl_ctrl,
                                            alg.kl_penalty, update_kl_ctrl=False)
        kld = algos.kl_penalty(batch.old_log_probs, batch.ref_log_probs, alg.kl_penalty)
        # verl's reward_kl_penalty over the global batch: token mean per response, then the
        # mean over all responses (AdaptiveKLController's per-token convention)
        current = dp_stats.row_mean(algos.masked_mean(kld, mask, dim=-1))
        metrics.update({"kl/current_kl": current, "kl/token_kl": current,
                        "kl/kl_coef": float(kl_ctrl.value)})
    else:
        rewards = token_scores
    values = batch["values"] if estimators.declares(alg, "needs_critic") else None
    baselines = None
    if estimators.declares(alg, "needs_greedy_baseline"):
        if "reward_baselines" not in batch:
            raise ValueError(f"algorithm.adv_estimator={alg.adv_estimator!r} needs a greedy "
                             "baseline per prompt (batch column reward_baselines, filled by the "
                             "trainer's rollout)")
        baselines = torch.tensor(batch["reward_baselines"], dtype=torch.float32,
                                 device=mask.device)
        metrics["reward/greedy_baseline_mean"] = dp_stats.row_mean(baselines)
    adv, ret = estimators.run_estimator(alg, rewards, mask, values, batch.group_index,
                                        reward_baselines=baselines)
    if whitens(alg):
        adv = dp_stats.masked_whiten(adv, mask)
    batch.token_level_rewards = rewards
    batch.advantages = adv.to(torch.float32)
    batch.returns = ret.to(torch.float32)
    return metrics
