"""The settings of asynchronous RL (``trainer.mode=async``, ``rl/async_rollout/``) in the
``rollout`` section: how stale a trained sample may be, what happens to one that is older, and
where the rollout server the trainer starts runs. :class:`AsyncRolloutFields` is a base of
``RolloutSection`` (the keys are ``rollout.max_staleness`` etc.); :func:`async_problems` are
the cross-field checks of an async run (``config/checks.py``) and :func:`async_correction`
switches the off-policy correction on by default in async mode.
"""

from __future__ import annotations

import logging
from typing import Literal, Optional

from pydantic import BaseModel, Field, StrictBool

from parallel_models.utils.optimizer_config import Int

logger = logging.getLogger(__name__)


class AsyncRolloutFields(BaseModel):
    """``rollout.max_staleness``, ``rollout.stale_policy``, ``rollout.partial``,
    ``rollout.server_devices``."""

    max_staleness: Int = Field(
        1, ge=0, description="trainer.mode=async: a sample is trained on only if its weights "
                             "are at most this many updates behind the trainer's (0 = on-policy: "
                             "the sync run's samples)")
    stale_policy: Literal["regenerate", "drop"] = Field(
        "regenerate", description="trainer.mode=async, a sample older than max_staleness: "
                                  "regenerate (its prompt again, current weights) | drop (kept "
                                  "out of the update: response_mask 0)")
    partial: StrictBool = Field(
        False, description="trainer.mode=async: partial rollouts: a weight push lands between "
                           "the server's decode steps and the requests in flight go on under the "
                           "new weights (each token's version recorded; staleness counts the "
                           "oldest); false = a push waits for them to finish")
    server_devices: Optional[str] = Field(
        None, description="trainer.mode=async without server_url: CUDA_VISIBLE_DEVICES of the "
                          "rollout server the trainer starts (e.g. \"1\"); null = inherited")


def async_problems(cfg) -> list[str]:
    """What an async run (``trainer.mode=async``) cannot combine with."""
    r = cfg.rollout
    if cfg.trainer.mode != "async":
        return ["rollout.partial=true needs trainer.mode=async"] if r.partial else []
    errors = []
    if r.backend not in ("inprocess", "server"):
        errors.append(f"trainer.mode=async generates on a rollout server; rollout.backend="
                      f"{r.backend} is neither inprocess (the trainer starts the server) nor "
                      "server (rollout.server_url)")
    if cfg.parallel.backend != "megatron":
        errors.append(f"trainer.mode=async pushes the megatron actor's weights to its rollout "
                      f"server: parallel.backend={cfg.parallel.backend} needs trainer.mode=sync")
    if cfg.algorithm.dynamic_sampling:
        errors.append("trainer.mode=async: algorithm.dynamic_sampling draws a step's prompt "
                      "batches one after another (needs trainer.mode=sync)")
    if r.multi_turn.max_turns > 1 or r.multi_turn.tools or r.multi_turn.environment:
        errors.append("trainer.mode=async: rollout.multi_turn conversations need "
                      "trainer.mode=sync")
    if r.exact:
        errors.append("trainer.mode=async: rollout.exact=true needs the in-process rollout "
                      "(trainer.mode=sync)")
    return errors


def async_correction(cfg) -> None:
    """In async mode the decoupled PPO objective is on by default: the rollout correction of
    the behaviour (rollout) log-probs against the proximal (recomputed old) ones, token level,
    truncated at 2.0 (verl's default cap). A run that sets ``actor.rollout_correction.level``
    or ``actor.tis_cap`` itself keeps its choice; one that turns it off is warned."""
    if cfg.trainer.mode != "async":
        return
    rc = cfg.actor.rollout_correction
    if "level" in rc.model_fields_set or cfg.actor.tis_cap is not None:
        if rc.level is None and cfg.actor.tis_cap is None:
            logger.warning("trainer.mode=async with actor.rollout_correction.level=null: stale "
                           "samples are trained on without importance weights (the decoupled "
                           "PPO correction is off)")
        return
    rc.level = "token"


__all__ = ["AsyncRolloutFields", "async_correction", "async_problems"]
