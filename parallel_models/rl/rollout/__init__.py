"""Rollout: the sampling params (``sampling.py``, shared by the PPO config, the engine, the server
and its client), generation with a KV cache (``generation.py``; decode-time cache and attention
in ``kv_cache.py``, CUDA-graph decode), the rollout engine the trainer calls in-process and the
server wraps (``engine.py``: n samples, seeds, atomic weight updates), and the HTTP rollout server
(``server/``) with its client."""
