"""A weight push off the pusher's critical path (an async RL run's trainer,
``rl/async_rollout/``): the weights are gathered bucket by bucket
(``weight_sync.BucketGatherer``, 64 MiB buckets: one small device buffer) into pinned host
buffers kept between pushes (a snapshot: the caller may change its weights at once), then
streamed to the server (``POST /update_weights_stream``, ``weight_stream.py``'s frames) on a
thread while the caller goes on. The server's receive, check and swap (with partial rollouts
also the running rows' KV recompute) overlap the caller's work; ``on_pushed(version, server
version)`` runs on the server's answer.

For one process (no collective to share the outcome with other ranks) and a full (not LoRA)
model; a push that fails is not retried (its weights are gone): the caller's next :meth:`push`,
:meth:`wait` or :meth:`check` raises it.
"""

from __future__ import annotations

import threading
import time

from parallel_models.inference.server.weight_stream import (STREAM_BUCKET_BYTES, HostBuffers,
                                                             bucket_frame, end_frame)
from parallel_models.inference.weight_sync import BucketGatherer


class BackgroundPush:
    """``BackgroundPush(model, client, on_pushed, on_failed)``: :meth:`push` (the caller's
    version) snapshots ``model`` and streams it to ``client``'s server on a thread; on the
    server's answer ``on_pushed(version, server version)``, on an error ``on_failed()``.
    ``seconds``: ``push_wait_s`` and ``snapshot_s`` of the last push (waiting for the push
    before it, the snapshot) and ``push_s`` of the last one answered (the send, until the
    server's answer)."""

    def __init__(self, model, client, on_pushed, on_failed=None,
                 bucket_bytes: int = STREAM_BUCKET_BYTES):
        self.model, self.client = model, client
        self.on_pushed, self.on_failed = on_pushed, on_failed
        self.bucket_bytes = bucket_bytes
        self._gatherer: BucketGatherer | None = None
        self._buffers: HostBuffers | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._phases: dict[str, float] = {}
        self._sent_s: float | None = None  # set by the sending thread

    @property
    def seconds(self) -> dict[str, float]:
        sent = self._sent_s
        return {**self._phases, **({} if sent is None else {"push_s": sent})}

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def push(self, version: int) -> None:
        """Wait for the previous push (raising its error), snapshot the weights, start sending."""
        t0 = time.perf_counter()
        self.wait()
        t1 = time.perf_counter()
        frames = self._snapshot()
        self._phases = {"push_wait_s": t1 - t0, "snapshot_s": time.perf_counter() - t1}
        self._thread = threading.Thread(target=self._send, args=(int(version), frames),
                                        name=f"weight-push-{version}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the push in flight (if any) is over; its error raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()

    def check(self) -> None:
        """Raise the error of a push that failed."""
        if self.error is not None:
            raise RuntimeError(f"the background weight push to {self.client.url} failed "
                               f"(the server keeps its previous weights): "
                               f"{type(self.error).__name__}: {self.error}") from self.error

    def _snapshot(self) -> list:
        """The push's frames: each bucket in a pinned host buffer of its own (reused)."""
        if self._gatherer is None:
            self._gatherer = BucketGatherer(self.model, self.bucket_bytes)
            self._buffers = HostBuffers(len(self._gatherer.buckets))
        self._buffers.turn = 0
        frames, count = [], 0
        for _, tensors in self._gatherer.buckets_iter():
            count += len(tensors)
            frames += bucket_frame(tensors, self._buffers)
        frames.append(end_frame(count))
        return frames

    def _send(self, version: int, frames: list) -> None:
        t0 = time.perf_counter()
        try:
            answer = self.client.push_weight_stream(iter(frames))
            self.on_pushed(version, answer["weight_version"])
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            self.error = exc
            if self.on_failed is not None:
                self.on_failed()
        self._sent_s = time.perf_counter() - t0


__all__ = ["BackgroundPush"]
