"""Rollout: generation with a KV cache (decode-time attention, CUDA-graph decode), the engine the
trainer calls in-process, and the HTTP rollout server (``server/``) with its client."""
