"""Shared training utilities: vocab-parallel log-probs, microbatching, padding, offload, the
optimizer and gradient buffers, compiled GPU pieces, the test-only fault points."""
