"""Tensor-parallel linears on megatron-core: fused QKV (GQA), fused gate-up, row-parallel.

Local layouts (what one TP rank holds, rows of the weight):
- QKV: ``[q heads of this rank; its KV heads' k; its KV heads' v]``. With fewer KV heads than TP
  ranks each rank holds one KV head, shared (replicated) by ``tp // num_kv_heads`` ranks.
- gate-up: ``[gate rows of this rank; up rows of this rank]``.
The checkpoint weight map (checkpoint_utils/weight_map.py) knows these layouts.
Each linear runs over the TP group of the ``ParallelLayout`` it is built in (``layout=``, default
the training layout).
"""

from __future__ import annotations

import torch
from megatron.core import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from parallel_models.distributed import layout_or_training
from parallel_models.llama.layers.row_overlap import (ChunkedRowParallelMatmul,
                                                      configured_overlap_chunks)


def _mark_tensor_parallel(module: torch.nn.Module, partition_dim: int) -> None:
    # megatron sets these only when it initializes the weight itself; we skip that (weights are
    # loaded), so set them here: grad-norm and checkpoint code rely on them.
    for name in ("weight", "bias"):
        p = getattr(module, name, None)
        if p is None or hasattr(p, "tensor_model_parallel"):
            continue
        is_split = name == "weight" or partition_dim == 0
        set_tensor_model_parallel_attributes(p, is_split, partition_dim if is_split else -1, 1)


def _init_normal(std: float):
    return lambda w: torch.nn.init.normal_(w, mean=0.0, std=std)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection, split by heads; KV heads replicated when num_kv_heads < TP."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 bias: bool, config: ModelParallelConfig, init_std: float = 0.02, layout=None):
        layout = layout_or_training(layout)
        tp = layout.tensor_parallel_size
        self.num_heads_per_rank = num_heads // tp
        self.num_kv_heads_per_rank = max(num_kv_heads // tp, 1)
        self.head_dim = head_dim
        local_out = (self.num_heads_per_rank + 2 * self.num_kv_heads_per_rank) * head_dim
        super().__init__(hidden_size, local_out * tp, config=config, init_method=_init_normal(init_std),
                         bias=bias, gather_output=False, tp_group=layout.tp_group)
        _mark_tensor_parallel(self, 0)
        self.q_size = self.num_heads_per_rank * head_dim
        self.kv_size = self.num_kv_heads_per_rank * head_dim

    def split(self, qkv: torch.Tensor):
        """[..., local_out] -> q [..., heads, d], k, v [..., kv_heads, d]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        shape = qkv.shape[:-1]
        return (q.reshape(*shape, self.num_heads_per_rank, self.head_dim),
                k.reshape(*shape, self.num_kv_heads_per_rank, self.head_dim),
                v.reshape(*shape, self.num_kv_heads_per_rank, self.head_dim))


class GateUpParallelLinear(ColumnParallelLinear):
    """Fused gate and up projections of a SwiGLU MLP; each rank holds [gate_local; up_local]."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool,
                 config: ModelParallelConfig, init_std: float = 0.02, layout=None):
        super().__init__(hidden_size, 2 * intermediate_size, config=config,
                         init_method=_init_normal(init_std), bias=bias, gather_output=False,
                         tp_group=layout_or_training(layout).tp_group)
        _mark_tensor_parallel(self, 0)


class ParallelRowLinear(RowParallelLinear):
    """Row-parallel output projection (o_proj, down_proj): input split, output reduced."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool,
                 config: ModelParallelConfig, init_std: float = 0.02, layout=None):
        super().__init__(input_size, output_size, config=config, init_method=_init_normal(init_std),
                         bias=bias, input_is_parallel=True, skip_bias_add=False,
                         tp_group=layout_or_training(layout).tp_group)
        _mark_tensor_parallel(self, 1)
        if self.bias is not None:
            # the bias is added after the reduction: replicated; with sequence parallel its
            # gradient is partial per rank and must be summed like the norms'.
            self.bias.sequence_parallel = config.sequence_parallel
        # k > 1: the output reduction overlaps the GEMM in k token chunks (row_overlap.py)
        self.overlap_chunks = configured_overlap_chunks()
        self.tp_world_size = (torch.distributed.get_world_size(self.tp_group)
                              if torch.distributed.is_initialized() else 1)

    def forward(self, input_):
        k = self.overlap_chunks
        # megatron's own path where it does more than a plain GEMM + reduction (the getattrs:
        # attributes some megatron-core versions lack)
        if (k <= 1 or self.tp_world_size <= 1 or not torch.is_grad_enabled()
                or getattr(self, "explicit_expert_comm", False)
                or getattr(self, "gradient_accumulation_fusion", False)
                or getattr(self.config, "delay_wgrad_compute", False) or input_.shape[0] < k
                or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())):
            return super().forward(input_)
        out = ChunkedRowParallelMatmul.apply(input_, self.weight, k, self.tp_group,
                                             self.sequence_parallel)
        return (out + self.bias if self.bias is not None else out), None
