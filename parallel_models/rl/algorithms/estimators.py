"""Advantage estimators by name (``algorithm.adv_estimator``): the built-in ``gae``, ``grpo`` and
``rloo``, a user's own from ``path/to/file.py:function``, and :func:`needs_critic`, the one
answer to "does this run have a critic" that the config checks, both backends and the advantage
phase use.

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
* ``whiten_by_default`` (default False): ``algorithm.whiten_advantages: null`` whitens.
"""

from __future__ import annotations

import torch

from parallel_models.rl.algorithms import core as algos
from parallel_models.rl.registry import Registry

ADVANTAGE_ESTIMATORS = Registry(
    "advantage estimator",
    params=("token_level_rewards", "response_mask", "values", "group_index", "config"),
    defaults={"needs_critic": False, "needs_groups": False, "whiten_by_default": False})


@ADVANTAGE_ESTIMATORS.register("gae", needs_critic=True, whiten_by_default=True)
def gae(token_level_rewards, response_mask, values, group_index, config):
    """Generalized advantage estimation (``config.gamma``, ``config.lam``) on the critic's
    values; the returns are ``advantages + values``."""
    del group_index
    return algos.compute_gae(token_level_rewards, values, response_mask, config.gamma,
                             config.lam, whiten=False)


@ADVANTAGE_ESTIMATORS.register("grpo", needs_groups=True)
def grpo(token_level_rewards, response_mask, values, group_index, config):
    """GRPO: each response's summed reward against its group's mean, divided by the group's
    std; returns = advantages."""
    del values, config
    seq_scores = algos.masked_sum(token_level_rewards, response_mask, dim=-1)
    adv = algos.compute_grpo_advantages(seq_scores, group_index, response_mask)
    return adv, adv.clone()


@ADVANTAGE_ESTIMATORS.register("rloo", needs_groups=True)
def rloo(token_level_rewards, response_mask, values, group_index, config):
    """RLOO: each response's summed reward minus the mean of the other samples of its prompt;
    returns = advantages."""
    del values, config
    seq_scores = algos.masked_sum(token_level_rewards, response_mask, dim=-1)
    adv = algos.compute_rloo_advantages(seq_scores, group_index, response_mask)
    return adv, adv.clone()


def estimator(alg):
    """The advantage estimator ``alg.adv_estimator`` (the ``algorithm`` section) names."""
    return ADVANTAGE_ESTIMATORS.get(alg.adv_estimator)


def declares(alg, attribute: str) -> bool:
    """What the estimator of ``alg`` declares (``needs_critic``, ``needs_groups``,
    ``whiten_by_default``)."""
    return bool(ADVANTAGE_ESTIMATORS.attribute(estimator(alg), attribute))


def needs_critic(cfg) -> bool:
    """Whether the run has a critic: its advantage estimator needs one. The config check makes
    ``critic.enable`` agree (null = this answer; true / false must match it)."""
    return declares(cfg.algorithm, "needs_critic")


def run_estimator(alg, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                  values: torch.Tensor | None, group_index: torch.Tensor):
    """``(advantages, returns)`` from the estimator of ``alg``, checked for shape."""
    fn = estimator(alg)
    out = fn(token_level_rewards=token_level_rewards, response_mask=response_mask,
             values=values, group_index=group_index, config=alg)
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


__all__ = ["ADVANTAGE_ESTIMATORS", "gae", "grpo", "rloo", "estimator", "declares",
           "needs_critic", "run_estimator"]
