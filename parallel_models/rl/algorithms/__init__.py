"""RL algorithms as pure torch: advantage estimators, policy losses and KL estimators (each a
registry by name, extensible from a user file), the advantage phase, the training-inference
mismatch metrics and its correction (importance weights, rejection)."""
