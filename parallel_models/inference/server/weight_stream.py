"""Weights pushed to the rollout server as one streamed HTTP body, without a folder on disk.

The trainer's ranks gather the actor bucket by bucket (``weight_sync.BucketGatherer``: HF
tensors, TP shards merged, PP stages broadcast); global rank 0 streams each bucket as a frame of
``POST /update_weights_stream``. The server stages the whole model in host memory, checks it
against its own model (every HF tensor of its weight map present, shapes right, nothing extra)
and only then swaps it in through the engine's atomic update (which also refuses non-finite
weights). A push cut midway (trainer gone, connection closed, a frame short) or a bad tensor
leaves the server on the old version with the old weights.

Wire format, frame after frame: 8 bytes little-endian header length, a JSON header, the payload.
A bucket's header is ``{"tensors": [[name, dtype, shape], ...], "nbytes": n}`` and its payload
the tensors' bytes back to back; the last frame is ``{"end": true, "tensors": total}`` with no
payload. A LoRA actor's push carries only its adapters, with ``"lora"`` (the PEFT settings) in
the first header: the server runs them on its base weights (``lora/served.py``).
"""

from __future__ import annotations

import json
import logging
import queue
import struct
import threading

import torch
import torch.distributed as dist

from parallel_models.inference.weight_sync import TensorReader

log = logging.getLogger(__name__)

_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


class WeightStreamError(RuntimeError):
    """A weight stream was cut short or malformed, or a tensor does not fit the model."""


def _frame(header: dict) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head


class HostBuffers:
    """A ring of ``count`` host buffers (pinned when the weights are on CUDA) reused bucket after
    bucket: a buffer comes round again only after ``count - 1`` newer buckets, by then sent
    (the sender's queue holds at most two buckets, one more is on the wire)."""

    def __init__(self, count: int = 4):
        self.count = count
        self.buffers: list[torch.Tensor | None] = [None] * count
        self.turn = 0

    def take(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        i, self.turn = self.turn, (self.turn + 1) % self.count
        buf = self.buffers[i]
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self.buffers[i] = torch.empty(numel, dtype=dtype, pin_memory=pinned)
        return buf[:numel]


def bucket_frame(tensors: dict[str, torch.Tensor], buffers: HostBuffers | None = None
                 ) -> tuple[bytes, memoryview]:
    """One bucket as (header bytes, payload): the tensors copied back to back into a host buffer
    (fresh, or the next of ``buffers``; the caller's tensors may be views of a buffer that the
    next bucket overwrites)."""
    first = next(iter(tensors.values()))
    total = sum(t.numel() for t in tensors.values())
    host = (buffers.take(total, first.dtype, first.is_cuda) if buffers is not None else
            torch.empty(total, dtype=first.dtype, pin_memory=first.is_cuda))
    entries, off = [], 0
    for name, t in tensors.items():
        host[off: off + t.numel()].copy_(t.reshape(-1), non_blocking=True)
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape)])
        off += t.numel()
    if first.is_cuda:
        torch.cuda.current_stream().synchronize()
    raw = host.view(torch.uint8).numpy()  # shares host's memory and keeps it alive
    return _frame({"tensors": entries, "nbytes": raw.nbytes}), memoryview(raw)


def end_frame(count: int) -> bytes:
    return _frame({"end": True, "tensors": count})


def unpack_bucket(entries, payload: bytearray, tensors: dict[str, torch.Tensor]) -> None:
    """Cut a bucket's payload into its tensors (views, no copy), added to ``tensors``."""
    off = 0
    for name, dtype, shape in entries:
        if dtype not in _DTYPES:
            raise WeightStreamError(f"{name}: unsupported dtype {dtype!r}")
        if name in tensors:
            raise WeightStreamError(f"{name}: sent twice")
        dt = _DTYPES[dtype]
        n = int(torch.Size(shape).numel()) * dt.itemsize
        if off + n > len(payload):
            raise WeightStreamError(f"{name}: payload shorter than its shape {shape}")
        flat = torch.frombuffer(payload, dtype=torch.uint8, offset=off, count=n) if n else \
            torch.empty(0, dtype=torch.uint8)
        tensors[name] = flat.view(dt).view(shape)
        off += n


class PushedWeights(TensorReader):
    """The staged tensors of a push plus the buckets they are views of: ``frames`` is a list of
    ``(entries, payload)``, entries ``[[name, dtype, shape], ...]`` in payload order and payload
    the bucket's bytes (a ``bytearray``)."""

    def __init__(self, tensors: dict[str, torch.Tensor], frames: list[tuple[list, bytearray]]):
        super().__init__(tensors, folder="<pushed>")
        self.frames = frames

    def headers(self) -> list[tuple[list, int]]:
        """What the command carries: each bucket's entries and byte count."""
        return [(entries, len(payload)) for entries, payload in self.frames]


class StreamParser:
    """Server side: feed the body's chunks (:meth:`feed`), then :meth:`finish` -> the staged HF
    tensors. Raises :class:`WeightStreamError` on a malformed or cut stream."""

    def __init__(self, max_header: int = 16 << 20):
        self.tensors: dict[str, torch.Tensor] = {}
        self.frames: list[tuple[list, bytearray]] = []  # (entries, payload) per bucket
        self.ended = False
        self.lora: dict | None = None  # an adapter push's settings (``lora/served.py``)
        self._buf = bytearray()
        self._header: dict | None = None
        self._payload: bytearray | None = None
        self._filled = 0
        self._max_header = max_header

    def feed(self, chunk) -> None:
        """Take the next chunk of the body: payload bytes go straight into their bucket's
        buffer; only frame headers are collected on the side."""
        if self.ended and len(chunk):
            raise WeightStreamError("data after the end frame")
        view, pos = memoryview(chunk), 0
        while pos < len(view):
            if self._payload is not None:
                take = min(len(self._payload) - self._filled, len(view) - pos)
                self._payload[self._filled:self._filled + take] = view[pos:pos + take]
                self._filled += take
                pos += take
                if self._filled == len(self._payload):
                    self._unpack(self._header["tensors"], self._payload)
                    self._header, self._payload = None, None
                continue
            if self.ended:
                raise WeightStreamError("data after the end frame")
            need = self._header_bytes_needed()
            take = min(need, len(view) - pos)
            self._buf += view[pos:pos + take]
            pos += take
            if take == need:
                self._read_header()

    def _header_bytes_needed(self) -> int:
        if len(self._buf) < 8:
            return 8 - len(self._buf)
        (n,) = struct.unpack("<Q", bytes(self._buf[:8]))
        if n > self._max_header:
            raise WeightStreamError(f"frame header of {n} bytes: not a weight stream")
        return 8 + n - len(self._buf)

    def _read_header(self) -> None:
        if len(self._buf) == 8:  # the length only: the header's bytes come next
            if self._header_bytes_needed():
                return
        try:
            header = json.loads(bytes(self._buf[8:]))
        except ValueError:
            raise WeightStreamError("malformed frame header") from None
        self._buf = bytearray()
        if header.get("end"):
            if header.get("tensors") != len(self.tensors):
                raise WeightStreamError(f"end frame says {header.get('tensors')} tensors, "
                                        f"{len(self.tensors)} arrived")
            self.ended = True
            return
        entries = header.get("tensors")
        if not isinstance(entries, list) or any(not isinstance(e, list) or len(e) != 3
                                                for e in entries):
            raise WeightStreamError("malformed bucket header")
        if isinstance(header.get("lora"), dict):
            self.lora = header["lora"]
        self._header = header
        self._payload = bytearray(int(header["nbytes"]))  # filled in place
        self._filled = 0
        if not self._payload:
            self._unpack(entries, self._payload)
            self._header, self._payload = None, None

    def _unpack(self, entries, payload: bytearray) -> None:
        unpack_bucket(entries, payload, self.tensors)
        self.frames.append((entries, payload))

    def finish(self) -> dict[str, torch.Tensor]:
        if not self.ended or self._payload is not None or self._buf:
            raise WeightStreamError(f"the weight stream was cut short ({len(self.tensors)} "
                                    "tensors arrived, no end frame)")
        return self.tensors


def check_against_model(tensors: dict[str, torch.Tensor], model) -> None:
    """Every HF tensor of ``model``'s weight map present with its shape, nothing else (a
    ``WeightStreamError`` naming the first problems otherwise)."""
    config = model.config
    want = {}
    for mapping, layer in model.weight_map.global_jobs(config, model.head_kind):
        for name, shape in zip(mapping.hf_names(layer), mapping.rule.hf_shapes(config)):
            want[name] = tuple(shape)
    problems = [f"{n}: missing" for n in want if n not in tensors]
    problems += [f"{n}: shape {tuple(t.shape)}, the model's is {want[n]}"
                 for n, t in tensors.items() if n in want and tuple(t.shape) != want[n]]
    problems += [f"{n}: not a tensor of this model" for n in tensors if n not in want]
    if problems:
        more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        raise WeightStreamError("pushed weights do not fit the model: " + "; ".join(problems[:5])
                                + more)


async def receive_weight_stream(request, engine):
    """Server side of ``POST /update_weights_stream``: the body parsed and checked against the
    engine's model -> the staged tensors (:class:`PushedWeights`, a loader reader) (:class:`WeightStreamError`
    otherwise, saying that the old version is kept)."""
    from starlette.requests import ClientDisconnect

    parser = StreamParser()
    try:
        async for chunk in request.stream():
            parser.feed(chunk)
        tensors = parser.finish()
        if parser.lora is not None:  # adapters only, the server runs them (lora/served.py)
            from parallel_models.lora.served import receive_adapter_push

            try:
                return receive_adapter_push(tensors, parser.lora, engine.model)
            except ValueError as err:
                raise WeightStreamError(str(err)) from None
        check_against_model(tensors, engine.model)
    except (WeightStreamError, ClientDisconnect) as exc:
        what = "the pusher disconnected" if isinstance(exc, ClientDisconnect) else str(exc)
        log.warning("weight push rejected (version %d kept): %s", engine.version, what)
        raise WeightStreamError(f"weight push rejected, version {engine.version} kept: "
                                f"{what}") from None
    return PushedWeights(tensors, parser.frames)


STREAM_BUCKET_BYTES = 64 * 2**20


def push_weight_stream(chunks, client, bucket_bytes: int | None = None) -> int | None:
    """Trainer side (every rank calls): gather the actor bucket by bucket and stream it from
    global rank 0 to the server. Buckets default to ``STREAM_BUCKET_BYTES`` (64 MiB): small
    enough that gathering, sending and the server's parsing overlap (with 512 MiB buckets a
    0.5B model is two buckets and the three steps ran one after the other: 9.8 s -> 6.2 s on
    CPU). Returns the new weight version on every rank; raises
    :class:`WeightStreamError` on every rank if the push failed (the server keeps its old
    weights). The collectives run to the end even when the HTTP side fails, so no rank hangs."""

    from parallel_models.inference.weight_sync import BucketGatherer

    gatherer = BucketGatherer(chunks, bucket_bytes or STREAM_BUCKET_BYTES)
    rank = dist.get_rank() if dist.is_initialized() else 0
    sender = _Sender(client) if rank == 0 else None
    host = HostBuffers(4)
    count = 0
    try:
        for _, tensors in gatherer.buckets_iter():
            count += len(tensors)
            if sender is not None:
                sender.put_all(bucket_frame(tensors, host))
        if sender is not None:
            sender.put_all([end_frame(count)])
    finally:
        outcome = sender.close() if sender is not None else None
    return shared_outcome(outcome, f"weight push to {client.url}")


def shared_outcome(outcome: tuple | None, what: str):
    """Rank 0's push ``outcome`` ``(version, error or None)`` on every rank (the others pass
    None): the new version, or :class:`WeightStreamError` naming ``what`` on every rank."""
    box = [outcome]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    version, error = box[0]
    if error is not None:
        raise WeightStreamError(f"{what} failed: {error}")
    return version


class _Sender:
    """The HTTP request on a thread, fed frames through a small queue (backpressure: at most a
    few buckets wait). If the request fails, later frames are dropped, not blocked on."""

    def __init__(self, client, depth: int = 4):  # two buckets (header + payload each)
        self.client = client
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.failed = threading.Event()
        self.result: dict | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="weight-push", daemon=True)
        self.thread.start()

    def _body(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            yield item

    def _run(self):
        try:
            self.result = self.client.push_weight_stream(self._body())
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the caller
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.failed.set()  # the request is over: nobody reads the queue any more
            while True:  # unblock a put waiting on a full queue
                try:
                    self.q.get_nowait()
                except queue.Empty:
                    break

    def put_all(self, parts) -> None:
        for part in parts:
            while not self.failed.is_set():
                try:
                    self.q.put(part, timeout=0.5)
                    break
                except queue.Full:
                    continue

    def close(self) -> tuple[int | None, str | None]:
        """End the body (a cut body if the caller raised first), wait, -> (version, error)."""
        if not self.failed.is_set():
            self.put_all([None])
        self.thread.join()
        if self.error is None and self.result is None:
            self.error = "no answer from the server"
        version = None if self.result is None else self.result.get("weight_version")
        return version, self.error


__all__ = ["HostBuffers", "PushedWeights", "StreamParser", "WeightStreamError", "bucket_frame", "check_against_model",
           "end_frame", "push_weight_stream", "receive_weight_stream", "shared_outcome",
           "unpack_bucket"]
