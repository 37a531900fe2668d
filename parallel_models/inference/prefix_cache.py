"""LRU of prompt KV by token ids, bounded in tokens: a prompt seen again skips its prefill.

An entry is the prompt's KV on this rank (``[layers, len, kv_heads, head_dim]`` each of K and V)
and the next-token logits after it (full vocab). Only an identical prompt hits. The cache must be
cleared whenever the weights change (``ContinuousEngine.clear_prefixes``): the KV was computed
with the old weights.
"""

from __future__ import annotations

import collections

import torch


class PrefixCache:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self.tokens = 0
        self.hits = 0
        self.misses = 0

    def get(self, prompt: list[int]):
        """``(k, v, logits)`` of ``prompt`` (most recently used now), or None."""
        key = tuple(prompt)
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, prompt: list[int], k: torch.Tensor, v: torch.Tensor, logits: torch.Tensor):
        key = tuple(prompt)
        if len(key) > self.max_tokens or key in self._entries:
            return
        self._entries[key] = (k, v, logits)
        self.tokens += len(key)
        while self.tokens > self.max_tokens:
            old, _ = self._entries.popitem(last=False)
            self.tokens -= len(old)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)


__all__ = ["PrefixCache"]
