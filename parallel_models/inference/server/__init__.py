"""Rollout server: the parallel CausalLM as an HTTP generation service (FastAPI + uvicorn).

Rank 0 speaks HTTP; the other TP ranks follow it over a gloo control group and run the rollout
engine's commands in lockstep. Start with ``python -m parallel_models.inference.server --model
PATH`` (or the ``parallel-models-serve`` console script; ``torchrun --nproc_per_node N ... --tp
N`` for TP > 1).
Talk to it with :class:`RolloutClient`.
"""

from parallel_models.inference.server.client import RolloutClient, ServerError

__all__ = ["RolloutClient", "ServerError"]
