"""Gradient synchronization that tensor/sequence parallelism needs outside megatron's DDP."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu


def allreduce_sequence_parallel_grads(model: torch.nn.Module) -> None:
    """Sum, over the TP group, the gradients of parameters that see only this rank's tokens
    under sequence parallel (norm weights, value head ...: marked ``sequence_parallel``).

    megatron-core's ``finalize_model_grads`` does the same inside its DDP; this is for plain
    (non-DDP) training loops and tests.
    """
    if mpu.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [p.grad for p in model.parameters()
             if p.grad is not None and getattr(p, "sequence_parallel", False)]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=mpu.get_tensor_model_parallel_group())
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)
