"""What the PPO trainer builds for ``parallel.backend=fsdp``: the actor, reference and critic
roles over FSDP2-sharded transformers models, and the rollout engine.

Rollout: for a family in our registry, our parallel CausalLM (TP=1) generates, refilled from the
FSDP actor layer by layer (``rollout_sync``) whenever the actor has taken an optimizer step since
the last fill; for other families the sharded HF actor generates itself (``hf_rollout``,
transformers' ``generate`` with ``synced_gpus``).
"""

from __future__ import annotations

import logging

from parallel_models.rl.backends.fsdp import models as fm
from parallel_models.rl.backends.fsdp.checkpoint import export_hf
from parallel_models.rl.backends.fsdp.forward import packed_sequences_supported
from parallel_models.rl.backends.fsdp.optim import build_fsdp_optimizer
from parallel_models.rl.backends.fsdp.roles import FSDPCriticRole, FSDPPolicyRole

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


class SyncedRolloutEngine:
    """The rollout engine of a registry family: ``generate`` first refills its model from the
    FSDP actor when the actor has changed (``actor.version``)."""

    def __init__(self, engine, actor):
        self.engine, self.actor = engine, actor
        self.synced_version = None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def sync(self) -> None:
        from parallel_models.rl.backends.fsdp.rollout_sync import sync_rollout_model

        if self.synced_version != self.actor.version:
            sync_rollout_model(self.actor.model, self.engine.model)
            self.synced_version = self.actor.version

    def generate(self, prompts, params, **kwargs):
        self.sync()
        return self.engine.generate(prompts, params, **kwargs)


def build_fsdp_roles(trainer, model_path: str) -> None:
    """Set ``trainer.actor`` / ``ref`` / ``critic`` / ``actor_model`` / ``rollout_engine``."""
    import torch

    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    # the draws of transformers' weight init (score heads, ...) must not move the run's RNG
    with torch.random.fork_rng(devices=cuda):
        _build(trainer, model_path)


def _build(trainer, model_path: str) -> None:
    import parallel_models as pm
    from parallel_models.inference.engine import RolloutEngine

    cfg = trainer.cfg
    par, a, tcfg = cfg.parallel, cfg.actor, cfg.trainer
    mesh = fm.device_mesh(par.fsdp_replicate_size)
    dtype = cfg.model.dtype

    def shard(model, trainable=True):
        return fm.shard_model(model, mesh, dtype=dtype, trainable=trainable,
                              activation_checkpointing=par.activation_checkpointing)

    temperature = cfg.rollout.temperature if not cfg.rollout.greedy else 1.0
    actor = shard(fm.load_causal_lm(model_path))
    packed = par.fsdp_packed and packed_sequences_supported(actor)
    if par.fsdp_packed and not packed:
        logger.warning("fsdp backend: %s's attention (%s) does not honour packed position ids "
                       "in this transformers version; using padded microbatches", model_path,
                       actor.config._attn_implementation)
    common = dict(max_tokens=a.micro_batch_tokens, packed=packed)
    trainer.actor = FSDPPolicyRole(actor, build_fsdp_optimizer(actor,
                                                               a.optim_config(tcfg.total_steps)),
                                   temperature=temperature, cfg=a, **common)
    alg = cfg.algorithm
    trainer.ref = None
    if alg.kl_in_reward or a.use_kl_loss:
        trainer.ref = FSDPPolicyRole(shard(fm.load_causal_lm(model_path), trainable=False),
                                     temperature=temperature, **common)
    trainer.critic = None
    from parallel_models.rl.algorithms.estimators import needs_critic
    if needs_critic(cfg):
        c = cfg.critic
        critic = shard(fm.load_value_model(c.path or model_path, seed=tcfg.seed))
        trainer.critic = FSDPCriticRole(critic, build_fsdp_optimizer(
            critic, c.optim_config(tcfg.total_steps)), cfg=c, loss_agg_mode=a.loss_agg_mode,
            **common)
    pad = trainer.tokenizer.pad_token_id
    special = dict(eos_token_id=trainer.tokenizer.eos_token_id,
                   pad_token_id=pad if pad is not None else 0)
    arch = registry_family(model_path)
    if arch is not None:
        cls = pm.get_model_class(arch, "causal_lm", rmpad=True)
        trainer.actor_model = cls.from_pretrained(model_path, dtype=dtype)
        trainer.actor_model.requires_grad_(False)
        trainer.rollout_engine = SyncedRolloutEngine(
            RolloutEngine(trainer.actor_model, **special, **cfg.rollout.engine_options()),
            trainer.actor)
        logger.info("fsdp backend: rollout with %s, refilled from the FSDP actor", cls.__name__)
    else:
        from parallel_models.rl.backends.fsdp.hf_rollout import HFRolloutEngine

        trainer.actor_model = None
        trainer.rollout_engine = HFRolloutEngine(actor, **special)
        logger.info("fsdp backend: %s is not in the registry; rollout with transformers' "
                    "generate on the sharded actor", model_path)


def export_roles_hf(trainer, output_dir: str) -> None:
    """``actor_hf/`` (with the tokenizer) and ``critic_hf/`` from the sharded models."""
    import os

    export_hf(trainer.actor.model, os.path.join(output_dir, "actor_hf"), trainer.tokenizer)
    if trainer.critic is not None:
        export_hf(trainer.critic.model, os.path.join(output_dir, "critic_hf"))
