"""Two nested config groups about what the trainer does with its samples:
``actor.rollout_correction`` (importance weights / rejection for the training-inference
mismatch, :class:`RolloutCorrectionFields`) and ``reward.overlong_buffer`` (DAPO's soft overlong
punishment, :class:`OverlongBufferFields`). Their sections (``sections.py``) hold them as
fields.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, Field, StrictBool, model_validator

from parallel_models.rl.config.section_config import SECTION_CONFIG
from parallel_models.utils.optimizer_config import Int, Number



class RolloutCorrectionFields(BaseModel):
    """``actor.rollout_correction``: importance weights / rejection for the training-inference
    mismatch (rl/algorithms/rollout_correction.py; docs/ALGORITHMS.md)."""

    model_config = SECTION_CONFIG

    level: Optional[Literal["token", "sequence", "geometric"]] = Field(
        None, description="token | sequence | geometric; null = no importance weights")
    mode: Literal["truncate", "mask"] = Field(
        "truncate", description="truncate (weight capped at hi) | mask (weight 0 outside "
                                "[lo, hi])")
    hi: Number = Field(2.0, gt=0, description="upper bound of the weights")
    lo: Optional[Number] = Field(None, gt=0, description="mask: lower bound; null = 1 / hi")
    reject: Optional[Literal[
        "seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_mean_k3", "seq_max_k2",
        "seq_max_k3"]] = Field(None, description="drop responses whose mismatch statistic "
                                                 "exceeds reject_threshold; null = off")
    reject_threshold: Optional[Number] = Field(None, gt=0, description="the bound of reject")

    @model_validator(mode="after")
    def _consistent(self) -> "RolloutCorrectionFields":
        name = "actor.rollout_correction"
        if self.lo is not None and self.mode != "mask":
            raise ValueError(f"{name}.lo is a bound of mode=mask (mode={self.mode} caps at hi "
                             "only); leave it null")
        if self.lo is not None and self.lo > self.hi:
            raise ValueError(f"{name}.lo ({self.lo}) must be <= {name}.hi ({self.hi})")
        if (self.reject is None) != (self.reject_threshold is None):
            raise ValueError(f"{name}.reject and {name}.reject_threshold go together (set both "
                             "or neither)")
        return self


class OverlongBufferFields(BaseModel):
    """``reward.overlong_buffer``: DAPO's soft overlong punishment (rl/rewards/overlong.py)."""

    model_config = SECTION_CONFIG

    enable: StrictBool = Field(False, description="add the length penalty to the reward")
    len: Int = Field(4, ge=1, description="the last len tokens before rollout.max_new_tokens "
                                          "are the buffer")
    penalty_factor: Number = Field(1.0, ge=0, description="penalty at rollout.max_new_tokens "
                                                          "(linear from 0 at the buffer's start)")
