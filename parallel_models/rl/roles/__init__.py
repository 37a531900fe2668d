"""The PPO roles over our parallel models (actor, reference, critic) and what they need: MoE routes
and aux loss, exact-mode log-probs, sharded optimizer state for checkpoints."""
