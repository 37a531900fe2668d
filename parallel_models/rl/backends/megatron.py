"""The megatron backend's side of the trainer's set-up: the actor, reference and critic roles
over our parallel models, and the in-process rollout engines (on the actor's weights, or the
hybrid engine's copy in the rollout layout). The fsdp backend's counterpart is
``rl/backends/fsdp/factory.py``."""

from __future__ import annotations

import parallel_models as pm
from parallel_models.rl.roles.model_roles import CriticRole, PolicyRole
from parallel_models.inference.engine import RolloutEngine
from parallel_models.utils.optimizer import build_optimizer


def build_roles(trainer, model_path: str) -> None:
    """``trainer``'s actor (and its ``actor_model``), reference and critic roles over our
    parallel models."""
    cfg, tcfg, a = trainer.cfg, trainer.cfg.trainer, trainer.cfg.actor
    dtype = cfg.model.dtype
    arch = pm.registry.architecture_of(model_path)
    pp = cfg.parallel.pipeline_parallel_size > 1  # PP variants: this rank's pipeline stage
    actor_cls = pm.get_model_class(arch, "causal_lm", rmpad=True, pp=pp)
    trainer.actor_model = actor_cls.from_pretrained(model_path, dtype=dtype)
    budget = a.micro_batch_tokens
    state = build_optimizer([trainer.actor_model], a.optim_config(tcfg.total_steps))
    trainer.actor = PolicyRole(trainer.actor_model, state,
                               temperature=cfg.rollout.temperature if not cfg.rollout.greedy
                               else 1.0, max_tokens=budget, cfg=a)
    alg = cfg.algorithm
    trainer.ref = None
    if alg.kl_in_reward or a.use_kl_loss:
        ref_model = actor_cls.from_pretrained(model_path, dtype=dtype)
        ref_model.requires_grad_(False)
        trainer.ref = PolicyRole(ref_model, None, temperature=trainer.actor.temperature,
                                 max_tokens=budget)
    trainer.critic = None
    from parallel_models.rl.algorithms.estimators import needs_critic
    if needs_critic(cfg):
        c = cfg.critic
        critic_path = c.path or model_path
        critic_cls = pm.get_model_class(pm.registry.architecture_of(critic_path), "value",
                                        rmpad=True, pp=pp)
        critic_model = critic_cls.from_pretrained(critic_path, dtype=dtype,
                                                  value_head_seed=tcfg.seed)
        critic_state = build_optimizer([critic_model], c.optim_config(tcfg.total_steps))
        trainer.critic = CriticRole(critic_model, critic_state, max_tokens=budget, cfg=c,
                                    loss_agg_mode=a.loss_agg_mode)


def build_rollout(trainer, rollout_tp: int) -> None:
    """``trainer.rollout_engine`` on the actor's weights and, when the rollout layout differs
    from the training one (TP' != TP, PP or EP > 1, in-process), ``trainer.hybrid``: the
    engine on a copy resharded into TP' that holds every layer and expert."""
    par, r = trainer.cfg.parallel, trainer.cfg.rollout
    pad = trainer.tokenizer.pad_token_id
    special = dict(eos_token_id=trainer.tokenizer.eos_token_id,
                   pad_token_id=pad if pad is not None else 0)
    trainer.rollout_engine = RolloutEngine(trainer.actor_model, **special, **r.engine_options())
    other_layout = (par.pipeline_parallel_size > 1 or par.expert_parallel_size > 1
                    or rollout_tp != par.tensor_parallel_size)
    if r.backend == "inprocess" and other_layout:
        from parallel_models.rl.rollout.hybrid import HybridRollout

        trainer.hybrid = HybridRollout(trainer.actor_model, rollout_tp, **special,
                                       offload=trainer._offload_enabled(),
                                       engine_options=r.engine_options())
