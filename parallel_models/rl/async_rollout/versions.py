"""Policy versions in an async run. The trainer names its weights by its step index (the
number of updates so far); the rollout server numbers the weights it holds by its own counter
(one per push, whatever pushed before). :class:`PolicyVersions` keeps the mapping, the last
version pushed, and lets the producer wait for one. The staleness of a sample is the trainer's
version when it trains on it minus the oldest version that drew one of its tokens.
"""

from __future__ import annotations

import threading
from typing import Sequence


class PolicyVersions:
    """The trainer versions pushed to the server (``pushed``) and the waits on them."""

    def __init__(self):
        self._changed = threading.Condition()
        self._by_server: dict[int, int] = {}
        self.current: int | None = None  # the trainer version the server holds now

    def pushed(self, version: int, server_version: int | None) -> None:
        """The server now holds the trainer's ``version`` (its own number ``server_version``)."""
        with self._changed:
            if server_version is not None:
                self._by_server[int(server_version)] = int(version)
            self.current = int(version)
            self._changed.notify_all()

    def trainer_version(self, server_version: int) -> int | None:
        """The trainer version of the server's ``server_version`` (None: not a push of ours)."""
        with self._changed:
            return self._by_server.get(int(server_version))

    def mapping(self) -> dict[int, int]:
        """A copy of server version -> trainer version, for every push of this run so far."""
        with self._changed:
            return dict(self._by_server)

    def wait_for(self, version: int, stopping: threading.Event) -> None:
        """Until the server holds trainer ``version`` or later (or ``stopping`` is set)."""
        with self._changed:
            while (self.current is None or self.current < version) and not stopping.is_set():
                self._changed.wait(0.2)

    def wake(self) -> None:
        with self._changed:
            self._changed.notify_all()


def sample_staleness(trainer_version: int, versions: Sequence[Sequence[int | None]]) -> list:
    """Per sample, ``trainer_version`` - the oldest version among its tokens' (None when one of
    them is unknown: weights someone else pushed to a shared fleet)."""
    out = []
    for tokens in versions:
        if any(v is None for v in tokens):
            out.append(None)
        else:
            out.append(trainer_version - min(tokens) if tokens else 0)
    return out


def too_stale(staleness: Sequence[int | None], max_staleness: int) -> list[bool]:
    """Per sample: may it not be trained on (older than ``max_staleness``, or unknown)?"""
    return [s is None or s > max_staleness for s in staleness]


__all__ = ["PolicyVersions", "sample_staleness", "too_stale"]
