"""Optimizer for the parallel models: megatron-core DDP + ``get_megatron_optimizer`` + LR scheduler.

``build_optimizer(chunks, OptimConfig(...))`` wraps each model chunk in megatron-core's
``DistributedDataParallel`` (grad buffers, data-parallel reduction, ``finalize_model_grads``),
builds the megatron optimizer (Adam; bf16/fp16 params keep fp32 master weights; optional
distributed optimizer; ``optimizer_offload_fraction``: megatron-core's CPU offload of the
optimizer states and their step, :func:`megatron_optimizer_config`) and an
``OptimizerParamScheduler``; with the option ``wgrad_fusion``
(``PARALLEL_MODELS_WGRAD_FUSION=1``) the linears' weight gradients accumulate straight into
DDP's fp32 buffers (``utils/wgrad_fusion.py``; off by default: slower on an H100); otherwise a
step's first backward writes the buffers instead of zeroing and adding
(``utils/grad_first_write.py``).
``optimizer_step`` clips and applies the gradients; ``parallel_models.pipeline.train_step`` runs
a whole step (forward-backward over microbatches through the pipeline schedules, then this), so
this utility needs no pipeline code.

``OptimConfig`` is a pydantic model (bounds, ``extra="forbid"``); its knobs live in
``OptimizerFields``, which the PPO config's ``actor`` and ``critic`` sections inherit (one
definition; ``section.optim_config(total_steps)`` builds the OptimConfig).

On the CPU, megatron-core's grad clipping asserts CUDA tensors, so there the global grad norm
and clipping are computed here with the same rules (TP duplicates and the tied embedding copy
counted once, reduced over the model-parallel group; MoE expert parameters, which megatron gives
their own optimizer, over the expert-parallel group) before the optimizer step.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from parallel_models import cpu_shim
from parallel_models.config import ConfigError
from parallel_models.utils import grad_first_write, wgrad_fusion
from parallel_models.utils.optimizer_config import (Int, Number,  # noqa: F401 (re-exported)
                                                OptimConfig, OptimizerFields)


@dataclasses.dataclass
class TrainState:
    chunks: list          # DDP-wrapped model chunks of this rank
    optimizer: object     # megatron MegatronOptimizer
    scheduler: OptimizerParamScheduler
    config: OptimConfig


def _check_trainable(model) -> None:
    cfg = model.config
    tp = mpu.get_tensor_model_parallel_world_size()
    if cfg.num_key_value_heads < tp:
        raise ConfigError(
            f"training with num_key_value_heads ({cfg.num_key_value_heads}) < "
            f"tensor_parallel_size ({tp}) is not supported: the replicated KV heads' gradients "
            "would need a sum over their replicas. Use TP <= num_key_value_heads.")


def wrap_for_training(chunks, use_distributed_optimizer: bool = False) -> list:
    """``chunks`` (one model or this rank's pipeline chunks) in megatron-core DDP: fp32 grad
    buffers, identical weights on every data-parallel replica, and, when asked for, the linears'
    weight gradients accumulated straight into those buffers (``utils/wgrad_fusion.py``).
    ``build_optimizer`` starts with this; benchmarks that time forward + backward as training
    runs it (no optimizer states) call it alone."""
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    for c in chunks:
        _check_trainable(c)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer)
    for c in chunks:
        # forward_backward normalizes by the global token count (finalize_model_grads), so
        # DDP must sum, not average, over data-parallel replicas
        c.mp_config.calculate_per_token_loss = True
    with cpu_shim.cuda_to_cpu(), grad_first_write.building():
        wrapped = [DistributedDataParallel(config=c.mp_config, ddp_config=ddp_config, module=c)
                   for c in chunks]
        # start from identical weights on every data-parallel replica
        for w in wrapped:
            w.broadcast_params()
    wgrad_fusion.enable(wrapped)
    for w in wrapped:  # a step's first backward writes the fp32 buffers instead of adding
        grad_first_write.enable(w)
    return wrapped


def build_optimizer(chunks, config: OptimConfig) -> TrainState:
    """Wrap ``chunks`` (one model or this rank's pipeline chunks) for training."""
    config.validate()
    cuda = torch.cuda.is_available()
    opt_config = megatron_optimizer_config(config, chunks_dtype(chunks), cuda)
    wrapped = wrap_for_training(chunks, opt_config.use_distributed_optimizer)
    with cpu_shim.cuda_to_cpu():
        optimizer = get_megatron_optimizer(opt_config, wrapped)
    return TrainState(wrapped, optimizer, lr_scheduler(optimizer, config), config)


def chunks_dtype(chunks) -> torch.dtype:
    return (chunks[0] if isinstance(chunks, (list, tuple)) else chunks).dtype


def megatron_optimizer_config(config: OptimConfig, dtype: torch.dtype,
                              cuda: bool) -> OptimizerConfig:
    """megatron-core's ``OptimizerConfig`` of ``config`` for weights of ``dtype``. With
    ``optimizer_offload_fraction`` > 0 on CUDA: megatron-core's CPU offload (its
    ``HybridDeviceOptimizer`` keeps that share of the fp32 states and runs their step on the
    host) on top of the distributed optimizer (switched on with it; at DP = 1 it shards
    nothing). Not the precision-aware path (it needs Transformer Engine). The CPU ignores the
    fraction: the states already live in host memory."""
    offload = cuda and config.optimizer_offload_fraction > 0
    fields = dict(
        optimizer="adam", lr=config.lr, min_lr=config.min_lr,
        weight_decay=config.weight_decay, adam_beta1=config.betas[0],
        adam_beta2=config.betas[1], adam_eps=config.eps,
        clip_grad=config.clip_grad if cuda else 0.0,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        use_distributed_optimizer=config.use_distributed_optimizer or offload)
    if offload:
        fields.update(optimizer_cpu_offload=True,
                      optimizer_offload_fraction=config.optimizer_offload_fraction,
                      overlap_cpu_optimizer_d2h_h2d=True,
                      pin_cpu_grads=True, pin_cpu_params=True)
    known = {f.name for f in dataclasses.fields(OptimizerConfig)}
    missing = sorted(set(fields) - known)
    if missing:
        raise ConfigError(f"optimizer_offload_fraction: this megatron-core has no "
                          f"{', '.join(missing)} (needs megatron-core >= 0.12)")
    with cpu_shim.cuda_to_cpu():
        return OptimizerConfig(**fields)


def lr_scheduler(optimizer, config) -> OptimizerParamScheduler:
    """megatron-core's schedule of ``config`` (warm-up, decay to ``min_lr`` over ``total_steps``,
    constant weight decay) over ``optimizer``'s param groups (``lr_mult`` / ``wd_mult``): the one
    schedule of both training backends."""
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if config.warmup_steps else config.lr, max_lr=config.lr,
        min_lr=config.min_lr, lr_warmup_steps=config.warmup_steps,
        lr_decay_steps=max(config.total_steps, config.warmup_steps + 1),
        lr_decay_style=config.lr_decay_style, start_wd=config.weight_decay,
        end_wd=config.weight_decay, wd_incr_steps=1, wd_incr_style="constant")


def _step_with_own_clipping(optimizer, max_norm: float):
    """megatron's ``optimizer.step()`` with the norm and clipping done here (CPU path).

    Same sequence as megatron: prepare (copy model grads to main grads, unscale), global norm
    over the main grads megatron selects for it (no TP duplicates, tied copy once) reduced over
    its grad-stats group (model-parallel, or the world for the distributed optimizer), clip,
    then the update.
    """
    if optimizer.prepare_grads():
        return False, None
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    total = 0.0
    for o in opts:  # MoE: the expert parameters' optimizer reduces over its own (EP) group
        sq = torch.zeros(1, dtype=torch.float64)
        # megatron-core 0.16 names it get_main_grads_for_grad_norm, 0.19 get_grads_for_grad_norm
        grads = getattr(o, "get_main_grads_for_grad_norm", None) or o.get_grads_for_grad_norm
        for g in grads():
            sq += g.detach().double().pow(2).sum().cpu()
        dist.all_reduce(sq, group=o.get_grad_stats_parallel_group())
        total += float(sq)
    norm = math.sqrt(total)
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for o in opts:
                for p in o.get_parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef)
    return optimizer.step_with_ready_grads(), norm


def zero_grads(state: TrainState) -> None:
    """Clear the DDP grad buffers and the optimizer's grads before a step's backward passes."""
    for c in state.chunks:
        c.zero_grad_buffer()
    state.optimizer.zero_grad()


def optimizer_step(state: TrainState) -> dict:
    """Clip and apply the accumulated gradients, advance the LR schedule. Returns
    ``{"grad_norm", "lr", "update_ok"}``. (``parallel_models.pipeline.train_step`` runs the
    forward-backward passes and this.)"""
    with cpu_shim.cuda_to_cpu():
        if torch.cuda.is_available():
            ok, grad_norm, _ = state.optimizer.step()
        else:
            ok, grad_norm = _step_with_own_clipping(state.optimizer, state.config.clip_grad)
    state.scheduler.step(1)
    return {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "lr": state.optimizer.param_groups[0]["lr"], "update_ok": bool(ok)}
