"""The fsdp training backend (``parallel.backend=fsdp``, ``rl/backends/registry.py``): the actor,
reference and critic roles over FSDP2-sharded transformers models, the reward, and the rollout.

Rollout: for a family in our registry, our parallel CausalLM (TP=1) generates, refilled from the
FSDP actor layer by layer (``rollout_sync``) at the first rollout after the actor changed
(``rl/rollout/inprocess.py``); for other families the sharded HF actor generates itself
(``hf_rollout``, transformers' ``generate`` with ``synced_gpus``; ``rl/rollout/hf_generate.py``).
"""

from __future__ import annotations

import logging

from parallel_models.rl.backends.fsdp import models as fm
from parallel_models.rl.backends.fsdp.checkpoint import export_hf as export_sharded_hf
from parallel_models.rl.backends.fsdp.forward import packed_sequences_supported
from parallel_models.rl.backends.fsdp.optim import build_fsdp_optimizer
from parallel_models.rl.backends.fsdp.roles import FSDPCriticRole, FSDPPolicyRole
from parallel_models.rl.backends.roles import Roles, rule_reward, special_tokens

logger = logging.getLogger(__name__)


def registry_family(path: str) -> str | None:
    """The HF architecture of ``path`` when our registry has its family, else None."""
    from parallel_models import registry
    from parallel_models.errors import ConfigError

    try:
        arch = registry.architecture_of(path)
        registry.family_of(arch)
        return arch
    except ConfigError:
        return None


def check_model(cfg) -> None:
    """Any transformers causal LM trains here (the config checks hold the layout rules)."""


def build_roles(cfg, tokenizer, model_path: str) -> Roles:
    """The actor, reference, critic (FSDP2-sharded transformers models), reward and rollout."""
    import torch

    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    # the draws of transformers' weight init (score heads, ...) must not move the run's RNG
    with torch.random.fork_rng(devices=cuda):
        actor, ref, critic, model, inprocess = _build(cfg, tokenizer, model_path)
    reward = rule_reward(cfg, tokenizer)
    if reward is None:  # any *ForSequenceClassification, sharded
        from parallel_models.rl.backends.fsdp.reward import FSDPRewardModel

        reward = FSDPRewardModel.from_config(cfg.reward, tokenizer, dtype=cfg.model.dtype,
                                             replicate=cfg.parallel.fsdp_replicate_size)
    from parallel_models.rl.backends.fsdp.models import compute_device
    from parallel_models.rl.rollout.registry import RolloutContext, build_rollout

    rollout = build_rollout(RolloutContext(
        cfg=cfg, actor=actor, model=None, **special_tokens(tokenizer), device=compute_device(),
        data_parallel_rank=_data_parallel_rank(), num_experts=None, inprocess=inprocess,
        tokenizer=tokenizer))
    return Roles(actor=actor, reference=ref, critic=critic, reward=reward, rollout=rollout,
                 model=model)


def _data_parallel_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _build(cfg, tokenizer, model_path: str):
    """(actor, reference, critic, the rollout copy or None, the in-process rollout's maker)."""
    import parallel_models as pm

    par, a, tcfg = cfg.parallel, cfg.actor, cfg.trainer
    mesh = fm.device_mesh(par.fsdp_replicate_size)
    dtype = cfg.model.dtype

    def shard(model, trainable=True):
        return fm.shard_model(model, mesh, dtype=dtype, trainable=trainable,
                              activation_checkpointing=par.activation_checkpointing)

    temperature = cfg.rollout.temperature if not cfg.rollout.greedy else 1.0
    lora = a.lora.settings()  # actor.lora.rank > 0: peft's LoRA, base frozen
    actor_model = fm.load_causal_lm(model_path)
    if lora is not None:
        from parallel_models.rl.backends.fsdp.lora import add_peft_lora, trainable_count

        actor_model = add_peft_lora(actor_model, lora)
        logger.info("actor: LoRA rank %d alpha %g on %s: %d trainable parameters (the adapters)",
                    lora.rank, lora.alpha, ",".join(lora.target_modules),
                    trainable_count(actor_model))
    actor_model = shard(actor_model)
    packed = par.fsdp_packed and packed_sequences_supported(actor_model)
    if par.fsdp_packed and not packed:
        logger.warning("fsdp backend: %s's attention (%s) does not honour packed position ids "
                       "in this transformers version; using padded microbatches", model_path,
                       actor_model.config._attn_implementation)
    common = dict(max_tokens=a.micro_batch_tokens, packed=packed)
    actor = FSDPPolicyRole(actor_model, build_fsdp_optimizer(
        actor_model, a.optim_config(tcfg.total_steps)), temperature=temperature, cfg=a, **common)
    alg = cfg.algorithm
    ref = None
    if (alg.kl_in_reward or a.use_kl_loss) and lora is not None:
        from parallel_models.rl.roles.lora_reference import AdapterFreeReference

        # the actor with peft's adapters off: no second copy of the base
        ref = AdapterFreeReference(actor, disabled=actor_model.disable_adapter)
    elif alg.kl_in_reward or a.use_kl_loss:
        ref = FSDPPolicyRole(shard(fm.load_causal_lm(model_path), trainable=False),
                             temperature=temperature, **common)
    critic = None
    from parallel_models.rl.algorithms.estimators import needs_critic
    if needs_critic(cfg):
        c = cfg.critic
        critic_model = fm.load_value_model(c.path or model_path, seed=tcfg.seed)
        if c.lora.settings() is not None:  # peft's SEQ_CLS LoRA, the score head trained whole
            from parallel_models.rl.backends.fsdp.lora import add_peft_value_lora, trainable_count

            add_peft_value_lora(critic_model, c.lora.settings())
            logger.info("critic: LoRA rank %d: %d trainable parameters (the adapters and the "
                        "value head)", c.lora.rank, trainable_count(critic_model))
        critic_model = shard(critic_model)
        critic = FSDPCriticRole(critic_model, build_fsdp_optimizer(
            critic_model, c.optim_config(tcfg.total_steps)), cfg=c, loss_agg_mode=a.loss_agg_mode,
            **common)
    special = special_tokens(tokenizer)
    arch = registry_family(model_path)
    if arch is None:
        from parallel_models.rl.backends.fsdp.hf_rollout import HFRolloutEngine
        from parallel_models.rl.rollout.hf_generate import HFGenerateRollout

        logger.info("fsdp backend: %s is not in the registry; rollout with transformers' "
                    "generate on the sharded actor", model_path)
        if cfg.rollout.dtype == "fp8":
            logger.warning("rollout.dtype=fp8: transformers' generate rolls out in %s", dtype)
        return actor, ref, critic, None, lambda: HFGenerateRollout(
            HFRolloutEngine(actor_model, **special))
    from parallel_models.inference import RolloutEngine
    from parallel_models.rl.backends.fsdp.rollout_sync import sync_rollout_model
    from parallel_models.rl.rollout.inprocess import InProcessRollout

    cls = pm.get_model_class(arch, "causal_lm", rmpad=True)
    model = cls.from_pretrained(model_path, dtype=dtype)
    model.requires_grad_(False)
    engine = RolloutEngine(model, **special, **cfg.rollout.engine_options())
    logger.info("fsdp backend: rollout with %s, refilled from the FSDP actor", cls.__name__)
    return actor, ref, critic, model, lambda: InProcessRollout(
        engine, refill=lambda: sync_rollout_model(actor_model, model))


def export_hf(roles: Roles, output_dir: str, tokenizer) -> None:
    """``actor_hf/`` (with the tokenizer) and ``critic_hf/`` from the sharded models; a LoRA
    actor (critic): ``actor_lora/`` (``critic_lora/``), a PEFT adapter folder, and the merged
    ``actor_hf/`` (``critic_hf/``)."""
    import os

    from parallel_models.rl.backends.fsdp.lora import (export_lora, export_value_lora,
                                                       is_lora_value_model, is_peft_model)

    if is_peft_model(roles.actor.model):
        export_lora(roles.actor.model, output_dir, tokenizer)
    else:
        export_sharded_hf(roles.actor.model, os.path.join(output_dir, "actor_hf"), tokenizer)
    if roles.critic is not None and is_lora_value_model(roles.critic.model):
        export_value_lora(roles.critic.model, output_dir)
    elif roles.critic is not None:
        export_sharded_hf(roles.critic.model, os.path.join(output_dir, "critic_hf"))


__all__ = ["build_roles", "check_model", "export_hf", "registry_family"]
