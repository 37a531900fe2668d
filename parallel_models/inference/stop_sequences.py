"""Stop token sequences: a sample ends once its generated ids end with one of them.

Besides single stop token ids (EOS, ``SamplingParams.stop_token_ids``), a generation may be given
``stop_sequences``: token-id sequences (e.g. the ids of ``</tool_call>`` when the tokenizer
splits it into several tokens). The sample stops right after the last token of the first
sequence it completes, and keeps those tokens (token in, token out: nothing is cut or
re-tokenized). Only generated ids count: a sequence that starts in the prompt does not match.

- :func:`check_stop_sequences`: the sequences as lists of ints, checked (ValueError);
- :func:`ends_with_stop_sequence`: the host check of the continuous batcher (one sample's ids);
- :class:`StopSequenceWindow`: the device check of the static batcher, one ``[B]`` mask per
  step without a host sync (a window of each row's last generated ids).
"""

from __future__ import annotations

from typing import Sequence

import torch


def check_stop_sequences(sequences) -> tuple[tuple[int, ...], ...]:
    """``sequences`` (token-id lists) as a tuple of int tuples; ValueError on an empty one or a
    negative id. None: no sequences."""
    if sequences is None:
        return ()
    out = []
    for i, seq in enumerate(sequences):
        seq = tuple(int(t) for t in seq)
        if not seq:
            raise ValueError(f"stop_sequences[{i}] is empty")
        if min(seq) < 0:
            raise ValueError(f"stop_sequences[{i}] has a negative token id")
        out.append(seq)
    return tuple(out)


def ends_with_stop_sequence(ids: Sequence[int], sequences) -> bool:
    """Whether ``ids`` (a sample's generated ids) end with one of ``sequences``."""
    n = len(ids)
    return any(n >= len(s) and tuple(ids[n - len(s):]) == s for s in sequences)


class StopSequenceWindow:
    """The last ``L`` generated ids of ``batch`` rows (``L`` the longest sequence) on ``device``;
    :meth:`push` adds a step's tokens and returns which rows now end with a sequence."""

    def __init__(self, sequences, batch: int, device):
        self.sequences = check_stop_sequences(sequences)
        width = max(len(s) for s in self.sequences)
        self.window = torch.full((batch, width), -1, dtype=torch.long, device=device)
        # each sequence right-aligned in the window, -2 (never an id) where it is shorter
        padded = [[-2] * (width - len(s)) + list(s) for s in self.sequences]
        self.patterns = torch.tensor(padded, dtype=torch.long, device=device)  # [S, L]
        self.care = self.patterns != -2

    def push(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens``: ``[B]`` the step's ids -> ``[B]`` bool, a sequence completed."""
        self.window = torch.cat([self.window[:, 1:], tokens.long()[:, None]], dim=1)
        same = (self.window[:, None, :] == self.patterns[None]) | ~self.care[None]
        return same.all(dim=-1).any(dim=-1)


__all__ = ["StopSequenceWindow", "check_stop_sequences", "ends_with_stop_sequence"]
