"""Value head (critic / reward model): hidden -> one scalar per token, replicated over TP."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region


class ValueHead(torch.nn.Module):
    """Named like HF's ``*ForSequenceClassification.score`` (num_labels=1, no bias)."""

    def __init__(self, hidden_size: int, *, sequence_parallel: bool, dtype=None, device=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel

    def reset_parameters(self, std: float, seed: int = 0) -> None:
        # the same values on every TP rank: draw from a fixed CPU generator
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=gen) * std)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [tokens(/tp), 1, H] -> values [tokens] (all tokens on every TP rank)."""
        if self.sequence_parallel:
            # every rank then scores all tokens itself, so the backward must split, not sum
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight).squeeze(-1).squeeze(-1)
