"""What a training backend hands the PPO trainer: :class:`Roles`, the actor, reference, critic,
reward and rollout of a run, built by the backend's ``build_roles`` (``registry.py``) on every
rank. The trainer only talks to them through the role protocol (``rl/roles/model_roles.py``)
and the rollout interface (``rl/rollout/interface.py``).

Also the pieces both backends share: the special tokens the engines stop and pad with, the rule
reward, and the ``offload`` setting of the roles (``trainer.offload`` on CUDA).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Roles:
    """``actor`` (trained; ``log_probs`` / ``update``), ``reference`` (frozen, None without a KL
    term), ``critic`` (None when the estimator has no critic), ``reward`` (``score``) and
    ``rollout`` (a :class:`~parallel_models.rl.rollout.interface.Rollout`). ``num_experts``: the
    actor's expert count when its rollouts carry routes (an MoE actor of the megatron backend:
    router replay, route metrics), else None. ``model``: the backend's own handle on the actor's
    weights (the megatron backend's parallel CausalLM, the fsdp backend's rollout copy), None where
    it has none."""

    actor: Any
    reference: Any | None
    critic: Any | None
    reward: Any
    rollout: Any
    num_experts: int | None = None
    model: Any | None = None

    def trainable(self) -> dict[str, Any]:
        """The roles with weights and optimizer states to checkpoint, by name."""
        roles = {"actor": self.actor}
        if self.critic is not None:
            roles["critic"] = self.critic
        return roles

    def resident(self) -> list:
        """Every role that can move between host and device (offload), in phase order."""
        return [r for r in (self.actor, self.reference, self.critic, self.reward)
                if r is not None]


def special_tokens(tokenizer) -> dict:
    """``eos_token_id`` / ``pad_token_id`` of the actor's tokenizer (pad 0 when it has none), as
    the rollout engines take them."""
    pad = tokenizer.pad_token_id
    return dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=pad if pad is not None else 0)


def offload_enabled(cfg) -> bool:
    """``trainer.offload`` takes effect (it needs CUDA)."""
    import torch

    return bool(cfg.trainer.offload) and torch.cuda.is_available()


def idle_grads_released(cfg) -> bool:
    """``trainer.release_idle_grads`` takes effect: null = on CUDA; never with trainer.offload
    (its Offloader releases the gradient buffers with everything else)."""
    import torch

    if offload_enabled(cfg):
        return False
    flag = cfg.trainer.release_idle_grads
    return torch.cuda.is_available() if flag is None else bool(flag)


def rule_reward(cfg, tokenizer):
    """``reward.type=rule``: the reward function of the config on the decoded text; None for a
    reward model (each backend loads its own)."""
    if cfg.reward.type != "rule":
        return None
    from parallel_models.rl.config.sections import reward_function_path
    from parallel_models.rl.rewards.rules import load_reward_function
    from parallel_models.rl.roles.model_roles import RuleReward

    return RuleReward(load_reward_function(reward_function_path(cfg)), tokenizer)


__all__ = ["Roles", "offload_enabled", "rule_reward", "special_tokens"]
