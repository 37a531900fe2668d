"""Trainer side of ``rollout.weight_push: group``: the actor broadcast to the rollout server over a
process group of trainer rank 0 + the server's ranks (server side and protocol:
``weight_group.py``; the group: ``side_group.py``).

Every trainer rank calls :func:`push_weight_group`: the ranks gather the actor bucket by bucket
in their training layout (``weight_sync.BucketGatherer``, kept between pushes so its buffers are
reused); global rank 0 joins the group on the first push (it hosts the ``TCPStore``, asks the
server to join with ``POST /weights_group/init``), posts each push's manifest (the buckets'
names, dtypes, shapes, known before any byte moves) and then sends every bucket straight from
the bucket buffer: one gloo / NCCL broadcast, or with ``ipc`` (same GPU) a handshake while the
server copies out of the buffer it opened once. The outcome reaches every trainer rank; a failure
(server gone, rejected, timed out) raises :class:`WeightStreamError` on every rank, and rank 0
drops the group so the next push joins afresh (``push_actor_weights`` falls back to the folder).
"""

from __future__ import annotations

import datetime
import logging
import time
import uuid

import torch
import torch.distributed as dist

from parallel_models.inference.server.weight_stream import WeightStreamError, shared_outcome

log = logging.getLogger(__name__)

GROUP_BUCKET_BYTES = 512 * 2**20
DEFAULT_TIMEOUT_S = 120.0


class GroupPusher:
    """Rank 0's end of the weights group (one per client): joins lazily, drops on failure."""

    def __init__(self, client, transport: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S):
        self.client = client
        self.transport = transport
        self.timeout_s = timeout_s
        self.side = None
        self.last_seconds: dict[str, float] = {}

    def connect(self, device: torch.device) -> None:
        from urllib.parse import urlparse

        from parallel_models.inference.server.side_group import SideGroup, local_address_towards

        self.drop()
        world = 1 + int(self.client.info()["tp"])
        addr = local_address_towards(urlparse(self.client.url).hostname or "127.0.0.1")
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(addr, 0, world, True, timeout, wait_for_workers=False)
        self.client.weights_group("init", {"master_addr": addr, "master_port": store.port,
                                           "world_size": world, "transport": self.transport,
                                           "timeout_s": self.timeout_s})
        self.side = SideGroup(addr, store.port, 0, world, device, self.timeout_s, self.transport,
                              store=store)
        log.info("weights group with %s: %s, %d members", self.client.url, self.side.transport,
                 world)

    def drop(self) -> None:
        if self.side is not None:
            self.side.close()
        self.side = None

    def manifest(self, gatherer, push_id: str) -> dict:
        dtype = str(gatherer.dtype).removeprefix("torch.")
        esize = torch.empty((), dtype=gatherer.dtype).element_size()
        buckets = [{"tensors": [[name, dtype, list(shape)] for job in b.jobs
                                for name, _, shape in job.slots], "nbytes": b.numel * esize}
                   for b in gatherer.buckets]
        ipc = None
        if self.side.transport == "ipc":
            from parallel_models.inference.server.cuda_ipc import export_handle

            ipc = export_handle(gatherer.flat(max(gatherer.buckets, key=lambda b: b.numel)))
        return {"buckets": buckets, "ipc": ipc, "push_id": push_id}

    def start(self, gatherer) -> str:
        """Join if needed, post the manifest, pass the go vote -> the push id (raises if the
        server cannot take the push; nothing was sent)."""
        from parallel_models.inference.server.client import ServerError

        push_id = uuid.uuid4().hex
        for attempt in (0, 1):
            if self.side is None:
                self.connect(gatherer.device)
            try:
                self.client.weights_group("update", self.manifest(gatherer, push_id))
                break
            except ServerError as err:
                if err.status != 409 or attempt:  # 409: the server lost the group (restarted)
                    raise
                self.drop()
        if self.side.max([0])[0]:  # (1) failed: the server skips to (4)
            self.side.max([0, 0])
            raise WeightStreamError(self._server_error(push_id, "the server could not stage "
                                                                "the push"))
        return push_id

    def send(self, flat: torch.Tensor) -> None:
        """One bucket (rank 0's bucket buffer view) to every server rank."""
        if self.side.transport == "ipc":
            torch.cuda.current_stream(flat.device).synchronize()
            self.side.max([0])  # ready: the server copies it now
            self.side.max([0])  # copied
        else:
            self.side.broadcast(flat.view(torch.uint8), root=0)

    def finish(self, push_id: str) -> int:
        """Votes (3) and (4): the server's new version, or raises with its reason."""
        self.side.max([0])
        failed, version = self.side.max([0, 0])
        if failed:
            raise WeightStreamError(self._server_error(push_id, "the server rejected the push"))
        return version

    def _server_error(self, push_id: str, fallback: str) -> str:
        """The server's message for ``push_id`` (recorded before it voted the outcome; a push
        refused at the go vote is recorded when its job ends, maybe later: then ``fallback``)."""
        try:
            status = self.client.weights_group("status")
        except Exception:  # noqa: BLE001 - keep the fallback text
            return fallback
        for last in (status.get("last_push") or {}, status.get("last") or {}):
            if last.get("push_id") == push_id and last.get("error"):
                return last["error"]
        return fallback


def _gatherer(client, chunks, bucket_bytes: int):
    """This rank's gatherer for ``chunks``, kept on the client between pushes (reused
    buffers; with ``ipc`` the same shared allocation every push)."""
    from parallel_models.inference.weight_sync import BucketGatherer

    cached = getattr(client, "_group_gatherer", None)
    key = (id(chunks), bucket_bytes)
    if cached is None or cached[0] != key:
        cached = (key, chunks, BucketGatherer(chunks, bucket_bytes))
        client._group_gatherer = cached
    return cached[2]


def pusher_of(client, transport: str = "auto") -> GroupPusher:
    """The client's :class:`GroupPusher` (made on first use; one per client)."""
    pusher = getattr(client, "_group_pusher", None)
    if pusher is None or pusher.transport != transport:
        pusher = client._group_pusher = GroupPusher(client, transport)
    return pusher


def _clean(exc: Exception) -> bool:
    """Whether the group is still in step after ``exc`` (the server refused the push and every
    collective ran), so the next push may reuse it."""
    from parallel_models.inference.server.client import ServerError

    return isinstance(exc, (WeightStreamError, ServerError))


def push_weight_group(chunks, client, bucket_bytes: int | None = None,
                      transport: str = "auto") -> int | None:
    """Every trainer rank calls: push the actor's current weights over the weights group.
    Returns the server's new weight version on every rank; raises :class:`WeightStreamError` on
    every rank if the push failed (the server keeps its old weights). The gathering collectives
    run to the end on every rank even when rank 0's side fails, so no rank hangs."""
    gatherer = _gatherer(client, chunks, bucket_bytes or GROUP_BUCKET_BYTES)
    rank = dist.get_rank() if dist.is_initialized() else 0
    pusher = pusher_of(client, transport) if rank == 0 else None
    error, version, push_id, broken = None, None, None, False
    t0 = time.perf_counter()
    if pusher is not None:
        try:
            push_id = pusher.start(gatherer)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error, broken = f"{type(exc).__name__}: {exc}", not _clean(exc)
    for bucket, _ in gatherer.buckets_iter():
        if pusher is not None and error is None:
            try:
                pusher.send(gatherer.flat(bucket))
            except Exception as exc:  # noqa: BLE001
                error, broken = f"{type(exc).__name__}: {exc}", True
    if pusher is not None and error is None:
        try:
            version = pusher.finish(push_id)
            pusher.last_seconds = {"push_s": time.perf_counter() - t0}
        except Exception as exc:  # noqa: BLE001
            error, broken = f"{type(exc).__name__}: {exc}", not _clean(exc)
    if broken:  # a collective failed midway, its peers may still be in one: join afresh next time
        pusher.drop()
    return shared_outcome((version, error), f"weight push over the group to {client.url}")


__all__ = ["GROUP_BUCKET_BYTES", "GroupPusher", "push_weight_group", "pusher_of"]
