"""RL algorithms as pure torch: advantage estimators, policy losses and KL estimators (each a
registry by name, extensible from a user file), the advantage phase and the training-inference
mismatch metrics."""
