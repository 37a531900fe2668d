"""Forwards of the fsdp backend's HF models on our microbatches, with outputs in packed order.

A microbatch (``rl.roles.make_microbatches``, or the reward model's) is a packed stream:
``input_ids`` / ``position_ids`` / ``cu_seqlens``. Either way below the result is
``[tokens, ...]`` in the packed order, so the megatron roles' log-prob / value gathering
applies unchanged:

- packed (RmPad, ``parallel.fsdp_packed``): one row ``[1, T]`` with the per-sequence position
  ids and no attention mask. transformers reads the sequence boundaries from the position ids
  (flash-attention varlen, or a block-diagonal mask for SDPA / eager:
  ``masking_utils.find_packed_sequence_indices``, which needs ``use_cache=False``).
- padded: the sequences as right-padded ``[B, S]`` rows with their attention mask and position
  ids, then the valid positions picked out.

Ranks of a sharded model must run the same number of forwards (and backwards): every one
all-gathers. :func:`synced_count` gives the number all ranks agree on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel_models.utils.padding import position_ids_from_attention_mask


def packed_sequences_supported(model) -> bool:
    """Whether transformers honours packed position ids for ``model``'s attention: flash
    attention (varlen from the position ids), or SDPA / eager with the packed-sequence masks of
    ``masking_utils`` (transformers >= 4.56)."""
    impl = getattr(model.config, "_attn_implementation", None) or ""
    if "flash" in impl:
        return True
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        return False
    return impl in ("sdpa", "eager")


def _tensor(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def forward_packed_order(model, mb: dict, packed: bool = True) -> torch.Tensor:
    """``model`` (a causal LM -> logits, or ``models.ValueModel`` -> values) on the packed
    stream of ``mb`` (``input_ids``, ``position_ids``, ``cu_seqlens``); ``[T, ...]`` in its
    order, from one packed row or from right-padded rows."""
    if packed:
        out = model(input_ids=mb["input_ids"][None],
                    position_ids=mb["position_ids"][None].long(), use_cache=False)
        return _tensor(out)[0]
    cu = mb["cu_seqlens"].long()
    lengths = cu[1:] - cu[:-1]
    mask = torch.arange(int(lengths.max()), device=cu.device)[None] < lengths[:, None]
    ids = torch.zeros(mask.shape, dtype=mb["input_ids"].dtype, device=cu.device)
    ids[mask] = mb["input_ids"]  # row-major: the packed order
    out = _tensor(model(input_ids=ids, attention_mask=mask.long(),
                        position_ids=position_ids_from_attention_mask(mask), use_cache=False))
    return out[mask]


def synced_count(n: int, device) -> int:
    """The largest ``n`` over all ranks (a collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def global_sum(value: float, device) -> float:
    """``value`` summed over all ranks, in float64 (a collective)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return float(t.item())
