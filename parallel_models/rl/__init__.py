"""RL post-training (PPO, GRPO, RLOO, ...): the entry point (``train.py``), the loop
(``trainer.py``), its checkpoints, config, algorithms, rewards, data, roles, metrics, the
training backends and the rollout adapters over the inference engine."""
