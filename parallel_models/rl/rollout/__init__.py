"""RL's side of rollout: the interface through which the trainer generates (``interface.py``:
``Rollout``, one batch shape for every backend), the rollout backends by name
(``registry.py``, ``rollout.backend``) and their adapters over the inference engine
(``parallel_models.inference``), one per file: ``inprocess`` (the engine in the trainer's
processes), ``hybrid_adapter`` (the hybrid engine, ``hybrid.py``: another layout, same processes),
``server`` (the HTTP rollout server and the weight pushes to it), ``hf_generate`` (the fsdp
backend's transformers ``generate``); ``samples_batch`` lays per-sample answers out as the batch."""
