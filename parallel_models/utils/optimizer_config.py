"""The optimizer settings as pydantic models (no torch, no megatron-core): ``OptimizerFields``
(the knobs the PPO config's ``actor`` and ``critic`` sections inherit) and ``OptimConfig`` (plus
the decay horizon), read by ``parallel_models.utils.optimizer.build_optimizer``. Kept apart from
the optimizer so that loading and checking a PPO config stays fast."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError,
                      field_validator)

from parallel_models.errors import ConfigError


def _not_bool(value):
    if isinstance(value, bool):
        raise ValueError("expected a number, not true/false")
    return value


Number = Annotated[float, BeforeValidator(_not_bool)]
Int = Annotated[int, BeforeValidator(_not_bool)]


class OptimizerFields(BaseModel):
    """The optimizer knobs, one definition: :class:`OptimConfig` adds the decay horizon; the PPO
    config's ``actor`` and ``critic`` sections inherit them."""

    model_config = ConfigDict(extra="forbid")

    lr: Number = Field(1e-5, gt=0, description="peak learning rate (Adam)")
    min_lr: Number = Field(0.0, ge=0, description="floor of the linear / cosine decay")
    weight_decay: Number = Field(0.0, ge=0, description="decoupled weight decay")
    betas: tuple[Number, Number] = Field((0.9, 0.999), description="Adam beta1, beta2")
    eps: Number = Field(1e-8, gt=0, description="Adam epsilon")
    clip_grad: Number = Field(1.0, ge=0, description="max global grad norm; 0 = off")
    warmup_steps: Int = Field(0, ge=0, description="linear warm-up from 0 to lr, in steps")
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="constant | linear | cosine (after warm-up)")
    use_distributed_optimizer: StrictBool = Field(
        False, description="shard optimizer states over data-parallel ranks (megatron-core)")
    optimizer_offload_fraction: Number = Field(
        0.0, ge=0, le=1, description="CUDA: share of the optimizer states kept, and stepped, "
                                     "in host memory (megatron-core's HybridDeviceOptimizer, "
                                     "with the distributed optimizer); 0 = all on the GPU; "
                                     "the CPU ignores it (the states are in host memory)")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas):
        if not all(0 <= b < 1 for b in betas):
            raise ValueError("Adam betas must be in [0, 1)")
        return betas

    def optim_config(self, total_steps: int) -> "OptimConfig":
        """This section's optimizer knobs with ``total_steps`` as the decay horizon."""
        return OptimConfig(**{k: getattr(self, k) for k in OptimizerFields.model_fields},
                           total_steps=total_steps)


class OptimConfig(OptimizerFields):
    total_steps: Int = Field(1_000_000, ge=1, description="decay horizon, in steps")

    def validate(self) -> "OptimConfig":  # re-check values assigned after construction
        try:
            type(self).model_validate(self.model_dump(warnings=False))
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                 for e in err.errors())
            raise ConfigError(f"invalid optimizer config: {problems}") from None
        return self
