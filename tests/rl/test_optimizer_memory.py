"""Optimizer memory (parallel_models.utils.optimizer): ``optimizer_offload_fraction`` reaches
megatron-core's OptimizerConfig as its CPU offload (HybridDeviceOptimizer, on the distributed
optimizer) on CUDA and is ignored on the CPU (the states are in host memory); the PPO config
takes it for the actor and critic with its bounds; a PPO run with the offload fraction and
recomputation on resumes after a kill exactly (CPU, where the fraction has nothing to move); the
distributed optimizer over DP=2 with recomputation gives the
single-rank run's metrics; its checkpoints resume exactly."""

import pytest
import torch

from parallel_models.utils.optimizer import OptimConfig, megatron_optimizer_config


def test_offload_reaches_megatron_config_on_cuda():
    cfg = megatron_optimizer_config(OptimConfig(lr=1e-5, optimizer_offload_fraction=0.5),
                                    torch.bfloat16, cuda=True)
    assert cfg.optimizer_cpu_offload and cfg.optimizer_offload_fraction == 0.5
    assert cfg.use_distributed_optimizer and cfg.bf16 and cfg.lr == 1e-5
    assert cfg.decoupled_weight_decay  # megatron's CPU offload runs AdamW only


def test_no_offload_by_default_or_on_the_cpu():
    plain = megatron_optimizer_config(OptimConfig(), torch.bfloat16, cuda=True)
    assert not plain.optimizer_cpu_offload and not plain.use_distributed_optimizer
    cpu = megatron_optimizer_config(OptimConfig(optimizer_offload_fraction=1.0), torch.float32,
                                    cuda=False)
    assert not cpu.optimizer_cpu_offload and not cpu.use_distributed_optimizer
    assert cpu.clip_grad == 0.0  # (the CPU clips in optimizer_step)
    dist = megatron_optimizer_config(OptimConfig(use_distributed_optimizer=True), torch.float32,
                                     cuda=False)
    assert dist.use_distributed_optimizer and not dist.optimizer_cpu_offload


def test_ppo_config_fields_and_bounds():
    from parallel_models.rl.config import load_config

    cfg = load_config(overrides=["actor.optimizer_offload_fraction=0.25",
                                 "critic.optimizer_offload_fraction=1",
                                 "actor.use_distributed_optimizer=true",
                                 "trainer.save_every=0"])
    assert cfg.actor.optimizer_offload_fraction == 0.25
    assert cfg.critic.optim_config(10).optimizer_offload_fraction == 1.0
    assert load_config().actor.optimizer_offload_fraction == 0.0
    with pytest.raises(Exception, match="optimizer_offload_fraction"):
        load_config(overrides=["actor.optimizer_offload_fraction=1.5"])


def test_resume_exact_with_distributed_optimizer_offload_fraction_and_recompute(tmp_path):
    """The actor on the distributed optimizer (its checkpoint: megatron-core's fully reshardable
    format through our weight factories), the critic on the plain one."""
    from tests.helpers.ppo_runs import resume_after_kill_matches

    resume_after_kill_matches(tmp_path, [
        "actor.use_distributed_optimizer=true",
        "actor.optimizer_offload_fraction=0.5", "critic.optimizer_offload_fraction=0.5",
        "actor.recompute=full", "critic.recompute=selective", "trainer.total_steps=4",
        "trainer.save_every=2", "trainer.save_hf_at_end=false", "trainer.loggers=[jsonl]"],
        steps=4)


def test_distributed_optimizer_over_dp2_with_recompute_equals_one_rank(tmp_path,
                                                                      hybrid_reference):
    """3 greedy PPO steps at DP=2 with the distributed optimizer (the states sharded over the
    two ranks) and recomputation give the single-rank plain run's metrics (rel <= 1e-5)."""
    from tests.helpers.hybrid_ppo_runs import assert_same_metrics, metrics_at

    got = metrics_at(tmp_path, 2, ["trainer.save_every=0", "actor.use_distributed_optimizer=true",
                                   "critic.use_distributed_optimizer=true",
                                   "actor.recompute=full", "critic.recompute=selective"], "dp2")
    assert_same_metrics(got, hybrid_reference, "dp2 distributed optimizer + recompute")
