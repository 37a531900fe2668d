"""Moving between padded ``(batch, seq)`` batches and packed (RmPad) token streams."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class PackedBatch:
    """Tokens of a padded batch packed end to end (padding removed).

    ``indices`` are the flat positions of the kept tokens in the ``(batch, seq)`` grid,
    ``cu_seqlens`` the int32 sequence boundaries (``batch + 1`` entries).
    """

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    position_ids: torch.Tensor
    indices: torch.Tensor
    batch_size: int
    seq_len: int


def position_ids_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over the valid tokens of each row (left or right padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def cu_seqlens_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    return torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - starts


def pack_padded_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      position_ids: torch.Tensor | None = None) -> PackedBatch:
    """``(batch, seq)`` ids + mask -> packed tokens; positions default to the mask's cumsum."""
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} must have the same shape")
    batch, seq = input_ids.shape
    mask = attention_mask.bool()
    if position_ids is None:
        position_ids = position_ids_from_attention_mask(attention_mask)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    lengths = mask.sum(-1)
    return PackedBatch(
        input_ids=input_ids.flatten()[indices],
        cu_seqlens=cu_seqlens_from_lengths(lengths),
        max_seqlen=int(lengths.max()) if batch else 0,
        position_ids=position_ids.flatten()[indices],
        indices=indices,
        batch_size=batch,
        seq_len=seq,
    )


def unpack_to_padded(packed: torch.Tensor, batch: PackedBatch, fill_value: float = 0.0
                     ) -> torch.Tensor:
    """Packed ``[tokens, ...]`` -> ``[batch, seq, ...]`` with ``fill_value`` at the padding."""
    out = packed.new_full((batch.batch_size * batch.seq_len, *packed.shape[1:]), fill_value)
    out = out.index_put((batch.indices,), packed)
    return out.view(batch.batch_size, batch.seq_len, *packed.shape[1:])
