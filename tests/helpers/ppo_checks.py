"""Workers for the PPO tests (run on gloo ranks)."""

from __future__ import annotations


def one_ppo_step_then_save(output_dir: str, tp: int) -> bool:
    from parallel_models.rl.config import load_config
    from parallel_models.rl.trainer import PPOTrainer

    cfg = load_config(None, [f"trainer.output_dir={output_dir}", "trainer.total_steps=1",
                             f"parallel.tensor_parallel_size={tp}",
                             "trainer.save_every=0", "trainer.loggers=[jsonl]",
                             "actor.ppo_epochs=1", "data.batch_size=4", "rollout.n=2",
                             "actor.mini_batch_size=8", "rollout.max_new_tokens=8"])
    cfg.validate()
    trainer = PPOTrainer(cfg)
    trainer.fit()
    return True


def _global_batch(vocab: int):
    """8 responses to 4 prompts (2 each): left-padded prompts, ragged responses with a hole,
    random scores / values / reference log-probs. The same on every rank (seeded)."""
    import torch

    from parallel_models.rl.data.batch import RolloutBatch

    g = torch.Generator().manual_seed(123)
    rows, P, R = 8, 5, 6
    seq = torch.randint(1, vocab, (rows, P + R), generator=g)
    am = torch.ones(rows, P + R, dtype=torch.long)
    for i in range(rows):
        am[i, :i % 3] = 0  # left padding
    rmask = torch.zeros(rows, R, dtype=torch.long)
    for i in range(rows):
        rmask[i, :2 + (i * 5) % (R - 1)] = 1
    rmask[3, 1] = 0  # a hole inside a response
    am[:, P:] = rmask
    return RolloutBatch(sequences=seq, attention_mask=am, prompt_lengths=am[:, :P].sum(-1),
                        response_mask=rmask, group_index=torch.arange(4).repeat_interleave(2),
                        scores=torch.randn(rows, generator=g),
                        values=torch.randn(rows, R, generator=g) * 0.5,
                        ref_log_probs=-torch.rand(rows, R, generator=g) * 3,
                        columns={"row": list(range(rows))})


def dp_advantages_and_update(model_path: str, loss_agg_modes: list[str]) -> dict:
    """This rank's share of one global batch (prompts dealt round-robin over the DP ranks):
    advantages (gae and grpo, whitened) and, per loss aggregation mode, one PPO actor update on
    the share from the same weights, whose loss and grad norm are global. DP=2 must equal DP=1
    on the same global batch."""
    from types import SimpleNamespace

    import torch
    from megatron.core import parallel_state as mpu

    import parallel_models as pm
    from parallel_models.rl.algorithms.advantages import compute_advantages
    from parallel_models.rl.algorithms.core import FixedKLController
    from parallel_models.rl.roles.model_roles import PolicyRole
    from parallel_models.utils.optimizer import OptimConfig, build_optimizer

    pm.init_parallel(tensor_parallel_size=1)
    rank, size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    cls = pm.get_model_class(pm.registry.architecture_of(model_path), "causal_lm", rmpad=True)

    def actor(mode):
        model = cls.from_pretrained(model_path, dtype=torch.float32)
        cfg = SimpleNamespace(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.2,
                              clip_ratio_c=3.0, entropy_coef=0.01, use_kl_loss=True,
                              kl_loss_coef=0.1, kl_loss_type="low_var_kl")
        # a small token budget: several microbatches per rank
        return PolicyRole(model, build_optimizer([model], OptimConfig(lr=1e-2, clip_grad=0.0)),
                          max_tokens=24, cfg=cfg)

    first = actor(loss_agg_modes[0])
    full = _global_batch(first.model.config.vocab_size)
    g = torch.Generator().manual_seed(7)
    full.old_log_probs = first.log_probs(full) + 0.05 * torch.randn(full.response_mask.shape,
                                                                     generator=g)
    out = {"rows": None, "update": {}}
    for estimator in ("gae", "grpo"):
        share = full.data_parallel_share(rank, size)
        alg = SimpleNamespace(adv_estimator=estimator, whiten_advantages=True, kl_in_reward=True,
                              kl_penalty="k1", gamma=1.0, lam=0.95)
        metrics = compute_advantages(share, alg, FixedKLController(0.2))
        out["rows"] = share.columns["row"]
        out[estimator] = {"advantages": share.advantages, "returns": share.returns,
                          "current_kl": metrics["kl/current_kl"]}
        if estimator == "gae":
            from parallel_models.rl.observe import dp_stats

            out["stats"] = {"max": dp_stats.data_parallel_max(share.scores),
                            "min": -dp_stats.data_parallel_max(-share.scores),
                            "mean": dp_stats.row_mean(share.scores),
                            "adv_mean": dp_stats.masked_mean(share.advantages,
                                                             share.response_mask)}
            for i, mode in enumerate(loss_agg_modes):
                out["update"][mode] = (first if i == 0 else actor(mode)).update(share)
    return out
