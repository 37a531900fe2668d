"""The megatron training backend (``parallel.backend=megatron``, ``registry.TRAINING_BACKENDS``):
the actor, reference and critic roles over our parallel models (TP x CP x PP x EP), the reward,
and the in-process rollout: the engine on the actor's own weights, or, when the rollout layout
differs from the training one (TP' != TP, PP, EP or CP > 1), the hybrid engine on a copy resharded
into TP' that holds every layer and expert. The fsdp backend's counterpart is
``rl/backends/fsdp/factory.py``.
"""

from __future__ import annotations

import logging
import os

import parallel_models as pm
from parallel_models.config import ConfigError
from parallel_models.rl.backends.builtin_model import BUILTIN_MOE, builtin_model_config
from parallel_models.rl.backends.roles import (Roles, idle_grads_released, rule_reward,
                                               special_tokens)

logger = logging.getLogger(__name__)


def check_model(cfg) -> None:
    """Before the process groups exist: the model is of a family in our registry, and its heads
    split over the training and the rollout TP."""
    par = cfg.parallel
    builtin = cfg.model.path in (None, BUILTIN_MOE)
    if not builtin:
        arch = pm.registry.architecture_of(cfg.model.path)
        if arch not in pm.registry.supported_architectures():
            raise ConfigError(
                f"{cfg.model.path}: architecture {arch!r} is not supported by the megatron "
                f"backend (supported: {', '.join(pm.registry.supported_architectures())}); "
                "train it with parallel.backend=fsdp (any transformers AutoModelForCausalLM)")
    from parallel_models.tokenizer import builtin_vocab

    model_config = pm.ModelConfig.from_hf(builtin_model_config(
        len(builtin_vocab()), moe=cfg.model.path == BUILTIN_MOE) if builtin else cfg.model.path)
    model_config.check_tensor_parallel(par.tensor_parallel_size)
    model_config.check_tensor_parallel(_rollout_tp(cfg))


def _rollout_tp(cfg) -> int:
    return cfg.rollout.tensor_parallel_size or cfg.parallel.tensor_parallel_size


def build_roles(cfg, tokenizer, model_path: str) -> Roles:
    """The actor, reference, critic (over our parallel models), reward and rollout."""
    from parallel_models.llama.layers.recompute import set_recompute
    from parallel_models.rl.roles.model_roles import CriticRole, PolicyRole
    from parallel_models.utils.optimizer import build_optimizer

    tcfg, a = cfg.trainer, cfg.actor
    dtype = cfg.model.dtype
    arch = pm.registry.architecture_of(model_path)
    pp = cfg.parallel.pipeline_parallel_size > 1  # PP variants: this rank's pipeline stage
    actor_cls = pm.get_model_class(arch, "causal_lm", rmpad=True, pp=pp)
    actor_model = actor_cls.from_pretrained(model_path, dtype=dtype)
    set_recompute(actor_model, a.recompute)
    lora = a.lora.settings()  # actor.lora.rank > 0: train the adapters only, base frozen
    if lora is not None:
        from parallel_models.lora.training import enable_lora

        enable_lora(actor_model, lora)
    budget = a.micro_batch_tokens
    state = build_optimizer([actor_model], a.optim_config(tcfg.total_steps))
    actor = PolicyRole(actor_model, state, temperature=cfg.rollout.temperature
                       if not cfg.rollout.greedy else 1.0, max_tokens=budget, cfg=a)
    alg = cfg.algorithm
    ref = None
    if (alg.kl_in_reward or a.use_kl_loss) and lora is not None:
        from parallel_models.rl.roles.lora_reference import AdapterFreeReference

        ref = AdapterFreeReference(actor)  # the actor with its adapters off: no second copy
    elif alg.kl_in_reward or a.use_kl_loss:
        ref_model = actor_cls.from_pretrained(model_path, dtype=dtype)
        ref_model.requires_grad_(False)
        ref = PolicyRole(ref_model, None, temperature=actor.temperature, max_tokens=budget)
    critic = None
    from parallel_models.rl.algorithms.estimators import needs_critic
    if needs_critic(cfg):
        c = cfg.critic
        critic_path = c.path or model_path
        critic_cls = pm.get_model_class(pm.registry.architecture_of(critic_path), "value",
                                        rmpad=True, pp=pp)
        critic_model = critic_cls.from_pretrained(critic_path, dtype=dtype,
                                                  value_head_seed=tcfg.seed)
        set_recompute(critic_model, c.recompute)
        if c.lora.rank:  # the adapters and the value head train, the base is frozen
            from parallel_models.lora.training import enable_lora

            enable_lora(critic_model, c.lora.settings(), "critic")
        critic_state = build_optimizer([critic_model], c.optim_config(tcfg.total_steps))
        critic = CriticRole(critic_model, critic_state, max_tokens=budget, cfg=c,
                            loss_agg_mode=a.loss_agg_mode)
    if idle_grads_released(cfg):  # (trainer.release_idle_grads) until their first update
        freed = sum(role.release_idle_grads() for role in (actor, critic) if role is not None)
        logger.info("trainer.release_idle_grads: %.1f MiB of gradient buffers freed outside "
                    "the update phases on this rank", freed / 2**20)
    reward = rule_reward(cfg, tokenizer)
    if reward is None:
        from parallel_models.rl.rewards.model import RewardModel  # issue: reward model role

        reward = RewardModel.from_config(cfg.reward, tokenizer)
    # an MoE actor: the rollout records routes (router replay, metrics)
    num_experts = actor_model.config.num_experts if actor_model.config.is_moe else None
    rollout = _build_rollout(cfg, tokenizer, actor, actor_model, num_experts, model_path)
    return Roles(actor=actor, reference=ref, critic=critic, reward=reward, rollout=rollout,
                 num_experts=num_experts, model=actor_model)


def _build_rollout(cfg, tokenizer, actor, actor_model, num_experts, model_path=None):
    """The rollout of ``rollout.backend``; in-process, the engine on the actor's weights or,
    in another layout, the hybrid engine."""
    from megatron.core import parallel_state as mpu

    from parallel_models.rl.rollout.registry import RolloutContext, build_rollout

    par, r = cfg.parallel, cfg.rollout
    special = special_tokens(tokenizer)

    def inprocess():
        other_layout = (par.pipeline_parallel_size > 1 or par.expert_parallel_size > 1
                        or par.context_parallel_size > 1  # generation runs at CP = 1
                        or _rollout_tp(cfg) != par.tensor_parallel_size)
        if other_layout:
            from parallel_models.rl.rollout.hybrid import HybridRollout
            from parallel_models.rl.rollout.hybrid_adapter import HybridEngineRollout

            # the rollout copy (another layout) is rewritten by the sync before every
            # generation: on CUDA its memory goes back between rollouts, trainer.offload or not
            hybrid = HybridRollout(actor_model, _rollout_tp(cfg), **special,
                                   release_copy=actor_model.device.type == "cuda",
                                   engine_options=r.engine_options())
            if cfg.actor.lora.rank and hybrid.weight_sync is not None:
                from parallel_models.lora.training import MergedWeightSync

                # the rollout copy gets the merged weights W + scale * B @ A
                hybrid.weight_sync = MergedWeightSync(hybrid.weight_sync, actor_model)
            return HybridEngineRollout(hybrid, num_experts=num_experts)
        from parallel_models.inference import RolloutEngine
        from parallel_models.rl.rollout.inprocess import InProcessRollout

        return InProcessRollout(RolloutEngine(actor_model, **special, **r.engine_options(),
                                              shares_training_weights=True),
                                num_experts=num_experts)

    return build_rollout(RolloutContext(
        cfg=cfg, actor=actor, model=actor_model, **special, device=actor_model.device,
        data_parallel_rank=mpu.get_data_parallel_rank(), num_experts=num_experts,
        inprocess=inprocess, tokenizer=tokenizer, model_path=model_path))


def export_hf(roles: Roles, output_dir: str, tokenizer) -> None:
    """``actor_hf/`` and ``critic_hf/``; the final weights replace those of an earlier (resumed
    or repeated) run. A LoRA actor (critic): ``actor_hf/`` (``critic_hf/``) holds the merged
    weights and ``actor_lora/`` (``critic_lora/``, with the value head) the adapters as a PEFT
    adapter folder."""
    _export(roles.model, output_dir, "actor")
    if roles.critic is not None:
        _export(roles.critic.model, output_dir, "critic")


def _export(model, output_dir: str, role: str) -> None:
    if getattr(model, "lora_settings", None) is not None:
        from parallel_models.lora import adapters_merged, save_adapter

        save_adapter(model, os.path.join(output_dir, f"{role}_lora"))
        with adapters_merged(model):
            model.save_pretrained(os.path.join(output_dir, f"{role}_hf"), overwrite=True)
    else:
        model.save_pretrained(os.path.join(output_dir, f"{role}_hf"), overwrite=True)


__all__ = ["build_roles", "check_model", "export_hf"]
