"""Workers for the PPO tests (run on gloo ranks)."""

from __future__ import annotations


def one_ppo_step_then_save(output_dir: str, tp: int) -> bool:
    from parallel_models.rl.config import load_config
    from parallel_models.rl.trainer import PPOTrainer

    cfg = load_config(None, [f"trainer.output_dir={output_dir}", "trainer.total_steps=1",
                             f"parallel.tensor_parallel_size={tp}",
                             "trainer.save_every=0", "trainer.tensorboard=false",
                             "actor.ppo_epochs=1", "data.batch_size=4", "rollout.n=2",
                             "actor.mini_batch_size=8", "rollout.max_new_tokens=8"])
    cfg.validate()
    trainer = PPOTrainer(cfg)
    trainer.fit()
    return True
