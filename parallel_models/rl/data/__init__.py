"""The RL data: prompt sets and their resumable loader, built-in verifiable tasks, and the batch
that travels between a step's phases."""
