"""Prefix-extending prefill of the continuous engine: a request that resumes from a kept region
(``scheduler.KeptKV``: a multi-turn conversation re-entering after a tool) runs only its new
tokens through the model; their attention reads the kept KV of the earlier positions from the
pool.

:func:`prefill_extensions` packs such requests (at most ``max_prefill_tokens`` new tokens a
pack) and returns each one's next-token logits. Each layer's attention goes through
:class:`ExtendingPrefill` (passed to the model as its ``kv_cache``): the new k / v are written
at ``start + kept + 0..new-1`` of the row's region, then every sequence's queries attend to its
region's first ``kept + new`` positions, causally (query j sits at position ``kept + j``), as
one masked SDPA call over the padded batch (GQA heads as they are). The KV of the kept
positions is the one the engine computed before (its prefill and decode steps), so the outputs
equal a prefill of the whole prompt up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ExtendingPrefill:
    """The ``kv_cache`` of one pack of extensions: ``starts`` (region starts), ``kept`` (KV
    positions already there) and ``new`` (tokens to add) per sequence, host ints."""

    def __init__(self, cache, starts: list[int], kept: list[int], new: list[int], device):
        self.cache = cache
        total = [k + n for k, n in zip(kept, new)]
        width = max(total)
        window = torch.arange(width, device=device)
        starts_t = torch.tensor(starts, device=device)
        kept_t = torch.tensor(kept, device=device)
        new_t = torch.tensor(new, device=device)
        q_width = max(new)
        # the new tokens' pool positions, packed in order
        seq = torch.repeat_interleave(torch.arange(len(new), device=device), new_t)
        first = torch.repeat_interleave(torch.cumsum(new_t, 0) - new_t, new_t)
        j = torch.arange(int(new_t.sum()), device=device) - first  # index within its sequence
        self.write = starts_t[seq] + kept_t[seq] + j
        self.q_slot = (seq, j)  # packed token -> (sequence, query row) of the padded batch
        # keys: the region's first `width` positions (clamped; masked beyond the sequence)
        self.key_index = (starts_t[:, None] + window[None, :]).clamp_(max=cache.end - 1)
        q_pos = kept_t[:, None] + torch.arange(q_width, device=device)[None, :]
        self.mask = (window[None, None, :] <= q_pos[:, :, None])[:, None]  # [B, 1, Tq, Tk]
        self.shape = (len(new), q_width)

    def fuses_rope(self) -> bool:
        return False

    def attend(self, layer: int, q, k, v, cu_seqlens, max_seqlen, scale, rope=None):
        cache = self.cache
        cache.store(layer, self.write, k, v)  # (an fp8 pool: quantized)
        b, t = self.shape
        heads, d = q.shape[1], q.shape[2]
        padded = q.new_zeros((b, t, heads, d))
        padded[self.q_slot] = q
        keys, values = cache.gather(layer, self.key_index)  # (an fp8 pool: dequantized)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, kv, Tk, d]
        out = F.scaled_dot_product_attention(padded.transpose(1, 2), keys, values,
                                             attn_mask=self.mask, scale=scale,
                                             enable_gqa=keys.shape[1] != heads)
        return out.transpose(1, 2)[self.q_slot]


def prefill_extensions(engine, items: list[tuple]) -> list[torch.Tensor]:
    """``items``: ``(prompt, region start, kept positions)`` per request; runs each prompt's
    tokens after its kept positions through the model, in packs of at most the engine's
    ``max_prefill_tokens`` new tokens. Returns each one's last-position logits (full vocab)."""
    device, logits = engine.device, []
    packs, tokens = [], 0
    for item in items:
        n = len(item[0]) - item[2]
        if not packs or tokens + n > engine.max_prefill_tokens:
            packs.append([])
            tokens = 0
        packs[-1].append(item)
        tokens += n
    for pack in packs:
        new = [p[kept:] for p, _, kept in pack]
        lengths = torch.tensor([len(x) for x in new], device=device)
        cu = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        ids = torch.tensor([t for x in new for t in x], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(kept, len(p), device=device) for p, _, kept in pack])
        cache = ExtendingPrefill(engine.cache, [s for _, s, _ in pack], [k for _, _, k in pack],
                                 [len(x) for x in new], device)
        hidden, _ = engine.model.forward_hidden(ids, cu, positions, max(map(len, new)),
                                                kv_cache=cache)
        last = engine.model._head(hidden[(cu[1:] - 1).long()], 0, full_vocab=True)
        logits += list(last)
        engine.prefill_calls += 1
        engine.prefilled_tokens += int(ids.numel())
    return logits


__all__ = ["ExtendingPrefill", "prefill_extensions"]
