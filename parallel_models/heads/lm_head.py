"""Vocab-parallel LM head: each TP rank computes the logits of its vocab rows (over the TP group of
the ``ParallelLayout`` it is built in, default the training layout)."""

from __future__ import annotations

import torch
from megatron.core import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, gather_from_tensor_model_parallel_region

from parallel_models.distributed import layout_or_training


class ParallelLMHead(torch.nn.Module):
    """hidden [tokens, 1, H] -> logits [tokens, 1, padded_vocab / tp].

    With tied embeddings the head holds no weight of its own; the caller passes the embedding's.
    Vocab rows added only to make the vocab divisible by TP get a very negative logit, so they
    never take probability mass in a vocab-parallel softmax, and are cut when gathering.
    """

    def __init__(self, hidden_size: int, vocab_size: int, padded_vocab_size: int, *,
                 mp_config: ModelParallelConfig, tied: bool, init_std: float = 0.02, layout=None):
        super().__init__()
        layout = layout_or_training(layout)
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_size
        self.tied = tied
        self.proj = ColumnParallelLinear(
            hidden_size, padded_vocab_size, config=mp_config, bias=False, gather_output=False,
            init_method=lambda w: torch.nn.init.normal_(w, 0.0, init_std),
            skip_weight_param_allocation=tied, tp_group=layout.tp_group)
        if not tied:
            self.proj.weight.tensor_model_parallel = True
            self.proj.weight.partition_dim = 0
            self.proj.weight.partition_stride = 1
        tp = layout.tensor_parallel_size
        rank = layout.tensor_parallel_rank
        per_rank = padded_vocab_size // tp
        self.vocab_start = rank * per_rank
        # number of real vocab rows on this rank (the padding is at the end of the last rank)
        self.num_real = max(0, min(per_rank, vocab_size - self.vocab_start))
        self.per_rank = per_rank

    @property
    def weight(self):
        return self.proj.weight

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        logits, _ = self.proj(hidden, weight=weight)
        if self.num_real < self.per_rank:
            pad = torch.arange(self.per_rank, device=logits.device) >= self.num_real
            logits = logits.masked_fill(pad, torch.finfo(logits.dtype).min)
        return logits

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel logits -> full-vocab logits (padding rows removed); differentiable."""
        full = gather_from_tensor_model_parallel_region(logits, group=self.proj.tp_group)
        return full[..., : self.vocab_size]
