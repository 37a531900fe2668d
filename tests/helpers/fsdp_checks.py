"""Workers for the fsdp backend tests (run on gloo ranks)."""

from __future__ import annotations

import os
from types import SimpleNamespace


def _share(model_path: str, log_probs):
    """This rank's share of ``ppo_checks._global_batch`` with old log-probs (``log_probs`` of the
    full batch + noise) and gae advantages, the same on both backends."""
    import torch
    from megatron.core import parallel_state as mpu

    from parallel_models.rl.algorithms.advantages import compute_advantages
    from parallel_models.rl.algorithms.core import FixedKLController
    from tests.helpers.ppo_checks import _global_batch

    from transformers import AutoConfig

    full = _global_batch(AutoConfig.from_pretrained(model_path).vocab_size)
    g = torch.Generator().manual_seed(7)
    full.old_log_probs = log_probs(full) + 0.05 * torch.randn(full.response_mask.shape,
                                                              generator=g)
    share = full.data_parallel_share(mpu.get_data_parallel_rank(),
                                     mpu.get_data_parallel_world_size())
    alg = SimpleNamespace(adv_estimator="gae", whiten_advantages=True, kl_in_reward=True,
                          kl_penalty="k1", gamma=1.0, lam=0.95)
    compute_advantages(share, alg, FixedKLController(0.2))
    return full, share


def save_tiny_phi3(folder: str, head: str = "causal_lm") -> str:
    """A tiny random transformers Phi-3 (fused qkv / gate_up: not a family of our registry)
    with the built-in tokenizer; ``head="value"``: a Phi3ForSequenceClassification."""
    import torch
    from transformers import Phi3Config, Phi3ForCausalLM, Phi3ForSequenceClassification

    from parallel_models.tokenizer import build_builtin_tokenizer

    tok = build_builtin_tokenizer()
    config = Phi3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                        num_labels=1)
    torch.manual_seed(0)
    cls = Phi3ForSequenceClassification if head == "value" else Phi3ForCausalLM
    cls(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


ACTOR_CFG = dict(loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2,
                 clip_ratio_c=3.0, entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                 kl_loss_type="low_var_kl")


def fsdp_vs_megatron_step(model_path: str, out_dir: str, clip_grad: float) -> dict:
    """One actor and one critic update with each backend from the same weights on the same
    rank share (several microbatches per rank); exports both backends' updated models. The
    fsdp critic runs HSDP (2 replicas of 1 shard) with activation checkpointing."""
    import torch

    import parallel_models as pm
    from parallel_models.rl.backends.fsdp import models as fm
    from parallel_models.rl.backends.fsdp.checkpoint import export_hf
    from parallel_models.rl.backends.fsdp.optim import build_fsdp_optimizer
    from parallel_models.rl.backends.fsdp.roles import FSDPCriticRole, FSDPPolicyRole
    from parallel_models.rl.roles.model_roles import CriticRole, PolicyRole
    from parallel_models.utils.optimizer import OptimConfig, build_optimizer

    pm.init_parallel(tensor_parallel_size=1)
    arch = pm.registry.architecture_of(model_path)
    opt = OptimConfig(lr=1e-3, clip_grad=clip_grad)
    cfg = SimpleNamespace(**ACTOR_CFG, cliprange_value=0.5)
    meg = pm.get_model_class(arch, "causal_lm", rmpad=True).from_pretrained(model_path,
                                                                           dtype=torch.float32)
    meg_actor = PolicyRole(meg, build_optimizer([meg], opt), max_tokens=24, cfg=cfg)
    megv = pm.get_model_class(arch, "value", rmpad=True).from_pretrained(
        model_path, dtype=torch.float32, value_head_seed=3)
    meg_critic = CriticRole(megv, build_optimizer([megv], opt), max_tokens=24, cfg=cfg)
    mesh = fm.device_mesh()
    f = fm.shard_model(fm.load_causal_lm(model_path), mesh)
    fsdp_actor = FSDPPolicyRole(f, build_fsdp_optimizer(f, opt), max_tokens=24, cfg=cfg)
    # the critic on a 2-D (replicate x shard) HSDP mesh, recomputing its layers in the backward
    fv = fm.shard_model(fm.load_value_model(model_path, seed=3), fm.device_mesh(replicate=2),
                        activation_checkpointing=True)
    fsdp_critic = FSDPCriticRole(fv, build_fsdp_optimizer(fv, opt), max_tokens=24, cfg=cfg)

    full, share = _share(model_path, meg_actor.log_probs)
    padded = FSDPPolicyRole(f, None, max_tokens=24, packed=False)  # the same sharded weights
    padded_critic = FSDPCriticRole(fv, None, max_tokens=24, packed=False)
    out = {"log_probs": (meg_actor.log_probs(share), fsdp_actor.log_probs(share)),
           "padded": (fsdp_actor.log_probs(share), padded.log_probs(share),
                      fsdp_critic.values(share), padded_critic.values(share)),
           "values": (meg_critic.values(share), fsdp_critic.values(share)),
           "actor": (meg_actor.update(share), fsdp_actor.update(share)),
           "critic": (meg_critic.update(share), fsdp_critic.update(share))}
    meg.save_pretrained(os.path.join(out_dir, "megatron_actor"), overwrite=True)
    megv.save_pretrained(os.path.join(out_dir, "megatron_critic"), overwrite=True)
    export_hf(f, os.path.join(out_dir, "fsdp_actor"))
    # the rollout engine's model (ours, TP=1) refilled from the updated FSDP actor
    from parallel_models.rl.backends.fsdp.rollout_sync import sync_rollout_model

    rollout = pm.get_model_class(arch, "causal_lm", rmpad=True).from_pretrained(
        model_path, dtype=torch.float32)
    sync_rollout_model(f, rollout)
    rollout.save_pretrained(os.path.join(out_dir, "rollout_actor"), overwrite=True)
    export_hf(fv, os.path.join(out_dir, "fsdp_critic"))
    return out


def fsdp_ppo_run(output_dir: str, model_path: str, steps: int) -> list[dict]:
    """``steps`` PPO steps of the trainer with parallel.backend=fsdp on ``model_path``."""
    from parallel_models.rl.config import load_config
    from parallel_models.rl.trainer import PPOTrainer

    cfg = load_config(None, [f"trainer.output_dir={output_dir}", f"trainer.total_steps={steps}",
                             f"model.path={model_path}", "parallel.backend=fsdp",
                             "trainer.save_every=0", "trainer.loggers=[jsonl]",
                             "data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=8",
                             "rollout.max_new_tokens=8", "actor.lr=1e-2", "critic.lr=1e-2"])
    cfg.validate()
    trainer = PPOTrainer(cfg)
    kind = type(trainer.rollout.engine).__name__  # the engine behind the rollout adapter
    return [{**m, "engine": kind} for m in trainer.fit()]


def fsdp_reward_scores(path: str) -> tuple:
    """Scores of the fsdp reward model for this rank's sequences (ranks hold different numbers
    of sequences and of microbatches) and transformers' own scores of the same sequences."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification

    import parallel_models as pm
    from parallel_models.rl.backends.fsdp.reward import FSDPRewardModel

    pm.init_parallel(tensor_parallel_size=1)
    rank = dist.get_rank()
    rm = FSDPRewardModel(path, dtype="float32", micro_batch_tokens=16)
    g = torch.Generator().manual_seed(5 + rank)
    lengths = torch.randint(3, 12, (5 if rank == 0 else 2,), generator=g).tolist()
    ids = [torch.randint(1, rm.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    got = rm.score_ids(ids)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([hf(input_ids=torch.tensor([s])).logits[0, 0] for s in ids])
    return got, want
