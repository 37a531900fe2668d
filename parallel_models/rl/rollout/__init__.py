"""RL's side of rollout: the adapters through which the trainer generates with the inference
engine (``parallel_models.inference``), in-process, through the hybrid engine (``hybrid.py``) or
against the HTTP rollout server."""
