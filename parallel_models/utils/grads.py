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


def allreduce_tied_embedding_grads(chunks: list[torch.nn.Module]) -> None:
    """Sum the gradient of the tied embedding / LM head over the first and last pipeline stage
    (megatron's embedding group), so both copies take the same step."""
    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return
    group = mpu.get_embedding_group()
    if dist.get_rank() not in dist.get_process_group_ranks(group):
        return
    module = chunks[0] if mpu.is_pipeline_first_stage(ignore_virtual=True) else chunks[-1]
    if not getattr(module, "share_embeddings_and_output_weights", False):
        return
    weight = module.shared_embedding_or_output_weight()
    grad = getattr(weight, "main_grad", None) if hasattr(weight, "main_grad") else weight.grad
    if grad is not None:
        dist.all_reduce(grad, group=group)
