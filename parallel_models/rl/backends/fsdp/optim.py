"""The fsdp backend's optimizer: ``torch.optim.AdamW`` over the sharded (DTensor) parameters,
the global grad norm and clipping over the mesh (``torch.nn.utils.clip_grad_norm_`` reduces
DTensor gradients over their mesh), and megatron-core's ``OptimizerParamScheduler`` so the LR
(warm-up, decay) and weight decay follow exactly the megatron backend's schedule.

Same rules as the megatron backend's optimizer (``utils/optimizer.py``): Adam is AdamW
(decoupled weight decay; megatron-core's CPU / fallback Adam is ``torch.optim.AdamW``), 1-D
parameters and biases get no weight decay, clipping scales by ``max_norm / (norm + 1e-6)`` when
that is below 1, the scheduler steps once per optimizer step.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from parallel_models.utils.optimizer import lr_scheduler
from parallel_models.utils.optimizer_config import OptimConfig


@dataclasses.dataclass
class FSDPTrainState:
    model: torch.nn.Module            # the fully_shard-ed model
    optimizer: torch.optim.Optimizer
    scheduler: OptimizerParamScheduler
    config: OptimConfig

    @property
    def chunks(self) -> list:
        return [self.model]


def build_fsdp_optimizer(model, config: OptimConfig) -> FSDPTrainState:
    config.validate()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    groups = [{"params": ps, "wd_mult": wd, "lr_mult": 1.0}
              for ps, wd in ((decay, 1.0), (no_decay, 0.0)) if ps]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=tuple(config.betas),
                                  eps=config.eps, weight_decay=config.weight_decay)
    return FSDPTrainState(model, optimizer, lr_scheduler(optimizer, config), config)


def _full(value) -> float:
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


def fsdp_optimizer_step(state: FSDPTrainState) -> dict:
    """Clip (global norm over the mesh) and apply the gradients, advance the LR schedule.
    Returns ``{"grad_norm", "lr", "update_ok"}`` like the megatron backend's step; a non-finite
    norm skips the update."""
    params = [p for g in state.optimizer.param_groups for p in g["params"] if p.grad is not None]
    max_norm = state.config.clip_grad if state.config.clip_grad > 0 else math.inf
    norm = _full(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
    ok = math.isfinite(norm)
    if ok:
        state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.scheduler.step(1)
    return {"grad_norm": norm, "lr": state.optimizer.param_groups[0]["lr"], "update_ok": ok}
