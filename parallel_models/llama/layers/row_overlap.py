"""Row-parallel forward with the TP reduction overlapped with the GEMM (training, TP > 1).

megatron-core's local ``RowParallelLinear`` (0.16 and 0.19) runs the whole GEMM, then one
blocking all-reduce (or reduce-scatter with sequence parallel): the o_proj / down_proj output
reduction is fully exposed. (Its column-parallel backward already overlaps the dgrad all-reduce
with the wgrad GEMM, ``LinearWithGradAccumulationAndAsyncCommunication``.) Here the tokens are
split into ``k`` chunks: chunk ``i``'s collective runs (``async_op=True``, NCCL's own stream)
while chunk ``i+1``'s GEMM runs; each GEMM writes straight into its slice of the output.
The backward is the plain row-parallel backward (sequence parallel: all-gather the output
gradient first). Switch: the option ``tp_overlap_chunks`` (``parallel_models.options``; env
``PARALLEL_MODELS_TP_OVERLAP_CHUNKS=k``; read when a layer is built; 0/1 = off, the default)
or :func:`set_tp_overlap_chunks` on a built model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel_models.options import option


def configured_overlap_chunks() -> int:
    """``k`` of the option ``tp_overlap_chunks`` (0 by default; validated there)."""
    return option("tp_overlap_chunks")


def set_tp_overlap_chunks(model: torch.nn.Module, chunks: int) -> int:
    """Set the chunk count of every row-parallel linear in ``model``; returns how many."""
    if chunks < 0:
        raise ValueError(f"tp overlap chunks must be >= 0, got {chunks}")
    n = 0
    for m in model.modules():
        if hasattr(m, "overlap_chunks"):
            m.overlap_chunks = chunks
            n += 1
    return n


def _bounds(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` near-equal contiguous row ranges of ``n`` rows (the first ``n % k`` one longer)."""
    base, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        size = base + (i < extra)
        if size:
            out.append((start, start + size))
        start += size
    return out


class ChunkedRowParallelMatmul(torch.autograd.Function):
    """``reduce(input @ weight.T)`` over the TP group, GEMM and collective pipelined by token
    chunks. ``input``: ``[tokens, ..., in_local]`` (tokens first, megatron's ``[s, b, h]``);
    with ``sequence_parallel`` the result is this rank's ``1/tp`` of the tokens (reduce-scatter
    along the first dimension, as megatron's ``reduce_scatter_to_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx, input_, weight, chunks: int, group, sequence_parallel: bool):
        ctx.save_for_backward(input_, weight)
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        lead = input_.shape[:-1]
        x = input_.reshape(-1, input_.shape[-1])
        wt = weight.t()
        if not sequence_parallel:
            out = x.new_empty(x.shape[0], weight.shape[0])
            handles = []
            for a, b in _bounds(x.shape[0], chunks):
                torch.mm(x[a:b], wt, out=out[a:b])
                handles.append(dist.all_reduce(out[a:b], group=group, async_op=True))
            for h in handles:
                h.wait()
            return out.view(*lead, weight.shape[0])
        tp = dist.get_world_size(group)
        if lead[0] % tp:
            raise ValueError(f"sequence parallel: {lead[0]} tokens not divisible by TP {tp}")
        rows = x.shape[0] // tp  # this rank's output rows (its block of the sequence)
        out = x.new_empty(rows, weight.shape[0])
        handles, staging = [], []
        for a, b in _bounds(rows, chunks):
            # rows a:b of every rank's block, one GEMM per block, then reduce-scatter
            buf = x.new_empty(tp, b - a, weight.shape[0])
            for r in range(tp):
                torch.mm(x[r * rows + a:r * rows + b], wt, out=buf[r])
            staging.append(buf)
            handles.append(dist.reduce_scatter_tensor(out[a:b], buf.view(-1, weight.shape[0]),
                                                      group=group, async_op=True))
        for h in handles:
            h.wait()
        return out.view(lead[0] // tp, *lead[1:], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        g = grad_output.contiguous()
        if ctx.sequence_parallel:
            tp = dist.get_world_size(ctx.group)
            full = g.new_empty(g.shape[0] * tp, *g.shape[1:])
            dist.all_gather_into_tensor(full, g, group=ctx.group)
            g = full
        g2 = g.reshape(-1, g.shape[-1])
        x = input_.reshape(-1, input_.shape[-1])
        grad_input = (g2 @ weight).view(input_.shape)
        grad_weight = g2.t() @ x
        return grad_input, grad_weight, None, None, None
