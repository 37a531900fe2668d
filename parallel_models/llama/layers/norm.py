"""RMSNorm computed exactly as transformers does (fp32 statistics, cast, then scale; or, with
``unit_offset``, Gemma's: scale by ``(1 + w)`` in fp32, then cast).

Over the last dim of any shape: the decoder's norms over ``hidden`` and Qwen3's per-head q/k
norms over ``head_dim`` (``[tokens, heads, head_dim]``, one weight shared by the heads)."""

from __future__ import annotations

import torch

from parallel_models.llama.layers.fused_ops import rms_norm


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, *, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None, device=None, unit_offset: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps
        self.unit_offset = unit_offset  # the weight is stored as in HF / megatron (w, not 1 + w)
        # Under sequence parallel each rank sees part of the tokens, so the weight's gradient is
        # partial: megatron's finalize_model_grads all-reduces params marked this way.
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.weight, self.eps, self.unit_offset)
