"""The RL data: prompt sets and their resumable loader, built-in verifiable tasks, the batch
that travels between a step's phases, and DAPO's dynamic sampling of groups."""
