"""``rollout.dtype=fp8`` and the rest of the PPO config.

An FP8 rollout samples from a slightly different policy than the one the trainer scores, so
rollout correction is on by default with it: unless ``actor.rollout_correction`` or
``actor.tis_cap`` is set, ``actor.rollout_correction.level`` becomes ``token`` (truncated
importance sampling, ``mode=truncate``, ``hi`` as configured: verl's TIS). Set to null
explicitly, it stays off and a warning says so (once per process). The mismatch metrics
(``rollout/logprob_diff_*``, ``rollout/k3_kl``: ``rl/algorithms/mismatch.py``) are logged every
step whenever the rollout returns its log-probs, FP8 or not.

With ``rollout.backend=server`` the server's own ``--quantization`` decides how it rolls out;
``rollout.dtype`` there only sets the correction default.

``rollout.kv_cache_dtype=fp8`` (the continuous engine's KV pool in e4m3, ``inference/
pool_cache``) changes the rollout's numerics too, so it cannot go with ``rollout.exact`` either;
it leaves the correction default as it is (``rollout.dtype`` sets it).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)
_warned_off = False


def fp8_rollout_defaults(cfg) -> None:
    """Turn on token-level truncated IS for ``rollout.dtype=fp8`` unless the correction was set
    (warn once if it was switched off)."""
    global _warned_off
    actor = cfg.actor
    rc = actor.rollout_correction
    if cfg.rollout.dtype != "fp8" or actor.tis_cap is not None or rc.level is not None \
            or rc.reject is not None:
        return
    if "level" in rc.model_fields_set:  # null given by the user: off on purpose
        if not _warned_off:
            _warned_off = True
            logger.warning("rollout.dtype=fp8 with actor.rollout_correction.level=null: the "
                           "FP8 rollout's mismatch with the trained policy goes uncorrected "
                           "(watch rollout/k3_kl; level=token is the default with fp8)")
        return
    actor.rollout_correction = rc.model_copy(update={"level": "token"})


def fp8_rollout_problems(cfg) -> list[str]:
    """Settings ``rollout.dtype=fp8`` and ``rollout.kv_cache_dtype=fp8`` cannot go with."""
    r = cfg.rollout
    problems = []
    if r.kv_cache_dtype == "fp8" and r.exact:
        problems.append("rollout.kv_cache_dtype=fp8 with rollout.exact=true: exact mode makes "
                        "the rollout log-probs equal the training ones bit for bit, which an "
                        "e4m3 KV cache cannot; set one of them")
    if r.dtype != "fp8":
        return problems
    if r.exact:
        problems.append("rollout.dtype=fp8 with rollout.exact=true: exact mode makes the "
                        "rollout log-probs equal the training ones bit for bit, which FP8 "
                        "weights cannot; set one of them")
    return problems


__all__ = ["fp8_rollout_defaults", "fp8_rollout_problems"]
