"""Admission of requests into the continuous-batching engine under a KV budget in tokens.

The KV pool (``pool_cache.PoolKVCache``) is one flat run of ``capacity`` token positions per
layer. A sample (one row of the decode batch) owns a contiguous region of ``len(prompt) +
max_new_tokens`` positions from admission until it finishes, so its KV never moves. A request of
``n`` samples is admitted as a whole (its prompt is prefilled once and copied into its n regions)
when ``n`` rows are free and ``n`` regions fit; otherwise it waits, first in, first out (a large
request at the head is not overtaken, so it cannot starve). A request that could not fit even
into an empty pool (``n * (prompt + max_new_tokens) > capacity``, or ``n`` over the row limit, or
one region over the per-row limit) is refused at once with :class:`KVBudgetError`.

Regions are placed first-fit in a sorted free list and merged with their neighbours when freed.

Kept regions (multi-turn re-entry, ``ContinuousEngine.submit(keep_kv=True)``): a finished sample
may keep its region (:meth:`Scheduler.keep`: its row is freed, its KV stays) as a
:class:`KeptKV`; a later request that extends the same tokens resumes from it (``resume``): it
takes the region over when it is large enough (its surplus freed), else a new region is
allocated and the engine copies the kept KV there (the old region is freed at the next
admission, after the copy is queued). A kept region is given back by
:meth:`Scheduler.release_kept`, or evicted when the head request cannot be placed (the latest
kept first, the head's own only when no row runs; the request resuming from an evicted one
prefills its whole prompt): kept KV gives way to the requests that need the room.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from typing import Any


class KVBudgetError(ValueError):
    """A request needs more KV memory (or rows) than the engine can ever give it."""


@dataclasses.dataclass(eq=False)
class KeptKV:
    """A finished sample's region kept for a request that extends its tokens: positions
    ``[start, start + length)`` hold the KV of ``tokens`` (``length`` of them); ``live`` is False
    once it was taken over, released or evicted."""

    start: int
    size: int
    tokens: tuple
    live: bool = True

    @property
    def length(self) -> int:
        return len(self.tokens)


class TokenPool:
    """First-fit allocator of contiguous regions in ``[0, capacity)``."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"KV budget must be >= 1 token, got {capacity}")
        self.capacity = capacity
        self._free: list[list[int]] = [[0, capacity]]  # sorted [start, end) runs
        self.used = 0

    def allocate(self, size: int) -> int | None:
        """Start of a free region of ``size`` positions, or None when none is that long."""
        for i, (start, end) in enumerate(self._free):
            if end - start >= size:
                if end - start == size:
                    del self._free[i]
                else:
                    self._free[i][0] = start + size
                self.used += size
                return start
        return None

    def free(self, start: int, size: int) -> None:
        i = bisect.bisect_left(self._free, [start, start + size])
        self._free.insert(i, [start, start + size])
        self.used -= size
        if i + 1 < len(self._free) and self._free[i][1] == self._free[i + 1][0]:
            self._free[i][1] = self._free.pop(i + 1)[1]
        if i > 0 and self._free[i - 1][1] == self._free[i][0]:
            self._free[i - 1][1] = self._free.pop(i)[1]


class Scheduler:
    """FIFO admission of requests (anything with ``n`` and ``row_tokens``) into rows and regions.

    ``capacity``: KV budget in token positions; ``max_rows``: decode batch rows at most;
    ``max_row_tokens``: the longest region one row may own (the decode kernel's key limit).
    """

    def __init__(self, capacity: int, max_rows: int, max_row_tokens: int):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.pool = TokenPool(capacity)
        self.max_rows = max_rows
        self.max_row_tokens = max_row_tokens
        self.rows_used = 0
        self.waiting: collections.deque = collections.deque()
        self.kept: dict[int, KeptKV] = {}  # id -> kept region, oldest first
        self._moved: list[tuple[int, int]] = []  # kept regions copied away, freed next admit
        self.evicted = 0

    def check(self, n: int, row_tokens: int) -> None:
        """Raise :class:`KVBudgetError` when ``n`` rows of ``row_tokens`` can never be admitted."""
        if row_tokens > self.max_row_tokens:
            raise KVBudgetError(
                f"a sample needs {row_tokens} KV positions (prompt + max_new_tokens); the engine "
                f"holds at most {self.max_row_tokens} per sample")
        if n * row_tokens > self.pool.capacity:
            raise KVBudgetError(
                f"the request needs {n} x {row_tokens} = {n * row_tokens} KV positions (n x "
                f"(prompt + max_new_tokens)); the KV budget is {self.pool.capacity} tokens")
        if n > self.max_rows:
            raise KVBudgetError(f"n={n} samples exceed the engine's {self.max_rows} batch rows")

    def add(self, request: Any) -> None:
        self.check(request.n, request.row_tokens)
        self.waiting.append(request)

    def admit(self) -> list[tuple[Any, list[int]]]:
        """Requests that start now, with the region start of each of their samples. A request
        resuming from a live :class:`KeptKV` (``request.resume``) gets ``extend_from`` (the
        positions whose KV it keeps) and ``moved_from`` (the kept start to copy from, or None
        when it took the region over)."""
        for start, size in self._moved:
            self.pool.free(start, size)
        self._moved.clear()
        started = []
        while self.waiting:
            req = self.waiting[0]
            if self.rows_used + req.n > self.max_rows:
                break
            starts = self._place(req)
            if starts is None:
                break
            self.waiting.popleft()
            self.rows_used += req.n
            started.append((req, starts))
        return started

    def _place(self, req) -> list[int] | None:
        kept = getattr(req, "resume", None)
        if kept is not None and not kept.live:
            kept = None
        if kept is not None and kept.size >= req.row_tokens:  # take the kept region over
            self._take(kept)
            if kept.size > req.row_tokens:  # (its surplus back to the pool)
                self.pool.free(kept.start + req.row_tokens, kept.size - req.row_tokens)
            req.extend_from, req.moved_from = kept.length, None
            return [kept.start]
        while True:
            starts = self._allocate(req)
            if starts is not None or not self.kept:
                break
            others = [k for k in self.kept.values() if k is not kept]
            if not others and not (kept is not None and kept.live and not self.rows_used):
                break
            # the head does not fit: evict kept regions, the latest kept first (its tool has
            # just started: it comes back last); the head's own only when no row runs
            self.evict(others[-1] if others else kept)
        if starts is not None and kept is not None and kept.live:  # copied to a new region
            self._take(kept)
            self._moved.append((kept.start, kept.size))
            req.extend_from, req.moved_from = kept.length, kept.start
        return starts

    def _allocate(self, req) -> list[int] | None:
        starts: list[int] = []
        for _ in range(req.n):
            start = self.pool.allocate(req.row_tokens)
            if start is None:
                break
            starts.append(start)
        if len(starts) < req.n:  # all or nothing: give back the partial allocation
            for s in starts:
                self.pool.free(s, req.row_tokens)
            return None
        return starts

    def keep(self, start: int, size: int, tokens) -> KeptKV:
        """A finished sample gives its row back and keeps its region (its KV of ``tokens``)."""
        self.rows_used -= 1
        kept = KeptKV(start, size, tuple(tokens))
        self.kept[id(kept)] = kept
        return kept

    def _take(self, kept: KeptKV) -> None:
        del self.kept[id(kept)]
        kept.live = False

    def release_kept(self, kept: KeptKV) -> None:
        """Give a kept region back (no-op when it is no longer live)."""
        if kept.live:
            self._take(kept)
            self.pool.free(kept.start, kept.size)

    def evict(self, kept: KeptKV) -> None:
        self.release_kept(kept)
        self.evicted += 1

    def drop_kept(self) -> None:
        """Evict every kept region (e.g. after a weight change: its KV is stale)."""
        for kept in list(self.kept.values()):
            self.evict(kept)

    def release(self, start: int, size: int) -> None:
        """A finished sample gives its row and region back."""
        self.pool.free(start, size)
        self.rows_used -= 1


__all__ = ["KVBudgetError", "KeptKV", "Scheduler", "TokenPool"]
