"""Server side of ``rollout.weight_push: group``: weights broadcast by the trainer over a process
group that joins trainer rank 0 and every server rank (``side_group.py``), no HTTP body.

Endpoints (JSON; the push's bytes never go through HTTP):

- ``POST /weights_group/init`` ``{"master_addr", "master_port", "world_size", "transport":
  "auto", "timeout_s"}`` -> 202 ``{"status": "joining", "world_size"}`` at once; the server's
  ranks then join the trainer's group, each on a thread of its own (generation goes on
  meanwhile), and the transport is agreed there; a join not done in ``timeout_s`` fails
  (``/weights_group/status``). ``world_size`` must be 1 + the server's ranks; ``master_addr``
  (and port) must be one of ``--allowed-weight-peers`` (default: loopback), else 403.
- ``POST /weights_group/update`` the manifest ``{"buckets": [{"tensors": [[name, dtype, shape],
  ...], "nbytes": n}, ...], "ipc": {...} | null, "push_id"}`` -> 400 at once if it does not
  fit the model (every HF tensor of the weight map, right shapes, nothing else), 409 if no
  group is joined; else 202 ``{"status": "receiving"}`` and, between batches, every rank
  receives the buckets into staging buffers (on the GPU for nccl / ipc, host memory for gloo),
  checks them finite, and only when every rank has them all and all are finite, loads them (no
  snapshot needed: nothing can fail any more) and bumps the version. With
  ``--partial-rollouts`` the job runs between two decode steps and the rows in flight go on
  under the new weights (``Engine.swap_in_flight``, as for the stream and folder pushes).
- ``GET /weights_group/status`` -> ``{"joined", "joining", "transport", "weight_version", "last",
  "last_push"}``: the last join / push job's result or error, and the last push's outcome as
  the server reported it to the trainer (what the trainer reads after a push that failed).

Per push, every member of the group runs the same collectives, so none can wait on another:
(1) a vote that every server rank allocated its staging; (2) each bucket: one broadcast from
the trainer (gloo or NCCL), or with ``ipc`` a ready / done handshake around the server's copy
out of the trainer's shared bucket buffer; (3) a vote that every rank staged everything finite;
(4) the outcome ``[failed, version]`` to the trainer. A peer that dies makes the collectives
raise (gloo: at once; otherwise after the group's timeout): the server drops the group and
keeps its old weights and version, unless (3) had passed on every rank (then the push is whole).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Literal, Optional

import torch
import torch.distributed as dist
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from parallel_models.inference.server.weight_stream import WeightStreamError, check_against_model
from parallel_models.inference.weight_sync import TensorReader

log = logging.getLogger(__name__)

DTYPES = {str(d).removeprefix("torch."): d for d in
          (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


class GroupInit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    master_addr: StrictStr = Field(min_length=1)
    master_port: StrictInt = Field(ge=1, le=65535)
    world_size: StrictInt = Field(ge=2)
    transport: Literal["auto", "gloo", "nccl", "ipc"] = "auto"
    timeout_s: float = Field(120.0, gt=0)


class Bucket(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tensors: list[tuple[StrictStr, StrictStr, list[StrictInt]]]
    nbytes: StrictInt = Field(ge=0)


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    buckets: list[Bucket]
    ipc: Optional[dict] = None  # transport ipc: the trainer's bucket buffer (cuda_ipc.py)
    push_id: Optional[StrictStr] = None  # echoed in /weights_group/status


def check_manifest(manifest: Manifest, model) -> None:
    """The manifest fits ``model`` (:class:`WeightStreamError` naming the problem otherwise):
    known dtypes, bucket sizes that add up, every tensor of the weight map once, right shapes."""
    metas: dict[str, torch.Tensor] = {}
    for i, bucket in enumerate(manifest.buckets):
        total = 0
        for name, dtype, shape in bucket.tensors:
            if dtype not in DTYPES:
                raise WeightStreamError(f"{name}: unsupported dtype {dtype!r}")
            if name in metas:
                raise WeightStreamError(f"{name}: sent twice")
            if any(s < 0 for s in shape):
                raise WeightStreamError(f"{name}: bad shape {shape}")
            metas[name] = torch.empty(shape, dtype=DTYPES[dtype], device="meta")
            total += metas[name].numel() * metas[name].element_size()
        if total != bucket.nbytes:
            raise WeightStreamError(f"bucket {i}: its tensors have {total} bytes, nbytes says "
                                    f"{bucket.nbytes}")
    check_against_model(metas, model)


def _server_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class PendingJoin:
    """This rank joining the trainer's group on a thread of its own, bounded by ``timeout_s``:
    the group is installed as ``engine.weight_group`` when the join ends in time; a join still
    hanging at the deadline is abandoned (its group, if it ever comes, closed)."""

    def __init__(self, req: GroupInit, engine):
        self.req, self.engine = req, engine
        self.deadline = time.monotonic() + req.timeout_s
        self.outcome: dict | None = None  # {"joined": True, ...} or {"error": message}
        self._lock = threading.Lock()
        self._settled = threading.Event()
        self._callbacks: list = []
        engine.pending_join = self  # before the threads start: _settle installs the group
        threading.Thread(target=self._join, name="weights-group-join", daemon=True).start()
        threading.Thread(target=self._watch, name="weights-group-deadline", daemon=True).start()

    def _join(self) -> None:
        from parallel_models.inference.server.side_group import SideGroup

        req = self.req
        try:
            side = SideGroup(req.master_addr, req.master_port, 1 + _server_rank(),
                             req.world_size, self.engine.rollout.device, req.timeout_s,
                             req.transport)
        except Exception as exc:  # noqa: BLE001 - reported in /weights_group/status
            self._settle({"error": f"joining the weights group failed: {type(exc).__name__}: "
                                   f"{exc}"})
            return
        if not self._settle({"joined": True, "transport": side.transport,
                             "world_size": side.world_size}, side):
            side.close()  # too late: the join was abandoned at its deadline
            return
        log.info("joined the weights group (%s, rank %d of %d)", side.transport, side.rank,
                 side.world_size)

    def _watch(self) -> None:
        if not self._settled.wait(max(0.0, self.deadline - time.monotonic())):
            self._settle({"error": f"joining the weights group at {self.req.master_addr}:"
                                   f"{self.req.master_port} timed out after "
                                   f"{self.req.timeout_s:g} s"})

    def _settle(self, outcome: dict, side=None) -> bool:
        with self._lock:
            if self._settled.is_set():
                return False
            if side is not None and self.engine.pending_join is self:
                self.engine.weight_group = side
            self.outcome = outcome
            self._settled.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(outcome)
        return True

    def on_settled(self, fn) -> None:
        """Call ``fn(outcome)`` once the join ends (now if it has)."""
        with self._lock:
            if not self._settled.is_set():
                self._callbacks.append(fn)
                return
        fn(self.outcome)

    def wait(self) -> dict:
        """The outcome, waiting at most until the deadline."""
        self._settled.wait(max(0.0, self.deadline - time.monotonic()) + 1.0)
        return self.outcome or {"error": "joining the weights group timed out"}

    def abandon(self) -> None:
        self._settle({"error": "the join was replaced or dropped"})


@dataclasses.dataclass
class JoinJob:
    """Every server rank starts joining the trainer's group (run through the engine's command
    mirror; the join itself runs on a :class:`PendingJoin` thread, off the batcher)."""

    init: dict

    def run_on_every_rank(self, engine) -> dict:
        drop_group(engine)
        PendingJoin(GroupInit.model_validate(self.init), engine)
        return {"joining": True}


def drop_group(engine) -> None:
    pending = getattr(engine, "pending_join", None)
    engine.pending_join = None
    if pending is not None:
        pending.abandon()
    side = getattr(engine, "weight_group", None)
    if side is not None:
        side.close()
    engine.weight_group = None


def _cut(manifest: Manifest, staging: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors = {}
    for bucket, raw in zip(manifest.buckets, staging):
        off = 0
        for name, dtype, shape in bucket.tensors:
            dt = DTYPES[dtype]
            n = int(torch.Size(shape).numel()) * dt.itemsize
            tensors[name] = raw[off: off + n].view(dt).view(shape)
            off += n
    return tensors


def _not_finite(manifest: Manifest, staging: list[torch.Tensor],
                tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the staged tensors with a NaN / inf (one check per bucket while all are fine)."""
    from parallel_models.inference.engine import all_finite

    bad = []
    for bucket, raw in zip(manifest.buckets, staging):
        dtypes = {DTYPES[d] for _, d, _ in bucket.tensors}
        if len(dtypes) == 1 and all_finite(raw.view(*dtypes)):
            continue
        bad += [n for n, _, _ in bucket.tensors if not all_finite(tensors[n])]
    return bad


@dataclasses.dataclass
class PushJob:
    """Every server rank receives a push over the group and swaps it in (see the module doc)."""

    manifest: dict

    def run_on_every_rank(self, engine) -> dict:
        pending = getattr(engine, "pending_join", None)
        if pending is not None:  # the push was queued behind a join still under way
            pending.wait()
        side = getattr(engine, "weight_group", None)
        if side is None:
            raise WeightStreamError("no weights group joined: POST /weights_group/init first")
        manifest = Manifest.model_validate(self.manifest)
        t0 = time.perf_counter()
        try:
            problem = self._receive(side, manifest, engine)
        except Exception as exc:  # noqa: BLE001 - a peer gone or timed out: the group is dead
            drop_group(engine)
            raise WeightStreamError(f"weight push over the group failed, version "
                                    f"{engine.version} kept: {type(exc).__name__}: {exc}") from None
        received = round(time.perf_counter() - t0, 3)
        answer, failed = None, 1
        if isinstance(problem, str):
            error = WeightStreamError(f"weight push rejected, version {engine.version} kept: "
                                      f"{problem}")
        else:
            group = engine.group if engine.world > 1 else None
            try:
                reader = TensorReader(problem, "<weights group>")
                answer = engine.swap_in_flight(lambda: engine.rollout.update_weights(
                    reader, group=group, keep_old=False))
                answer["receive_seconds"], failed, error = received, 0, None
            except Exception as exc:  # noqa: BLE001 - reported to the trainer below
                error = exc
        # recorded before the trainer hears the outcome, so its status request finds it
        engine.last_group_push = ({"push_id": manifest.push_id, "ok": True, **answer}
                                  if error is None else
                                  {"push_id": manifest.push_id, "ok": False, "error": str(error)})
        try:
            side.max([failed, engine.version])  # (4) the outcome, to the trainer
        except Exception:  # noqa: BLE001 - the trainer is gone; the push itself is whole
            drop_group(engine)
            log.warning("weights group: the trainer left before the outcome of the push")
        if error is not None:
            raise error
        return answer

    @staticmethod
    def _receive(side, manifest: Manifest, engine) -> dict[str, torch.Tensor] | str:
        """Steps (1)-(3): the staged tensors, or why they cannot be used (every rank agrees)."""
        on_device = side.transport in ("nccl", "ipc")
        device = engine.rollout.device if on_device else torch.device("cpu")
        try:
            staging = [torch.empty(b.nbytes, dtype=torch.uint8, device=device)
                       for b in manifest.buckets]
            short = 0
        except (MemoryError, torch.OutOfMemoryError):
            staging, short = [], 1
        if side.max([short])[0]:  # (1)
            return "a server rank is out of memory for the staging buffers"
        problem = None
        source = None
        if side.transport == "ipc":
            try:
                from parallel_models.inference.server.cuda_ipc import open_handle

                source = open_handle(manifest.ipc or {}).reshape(-1).view(torch.uint8)
            except (ValueError, RuntimeError) as exc:
                problem = f"cannot open the trainer's CUDA IPC buffer: {exc}"
        for raw in staging:  # (2)
            if side.transport != "ipc":
                side.broadcast(raw, root=0)
                continue
            side.max([0])  # the trainer's bucket is ready in its buffer
            if source is not None and problem is None:
                raw.copy_(source[: raw.numel()])
                torch.cuda.current_stream(raw.device).synchronize()
            side.max([0])  # copied: the trainer may overwrite its buffer
        del source
        tensors = _cut(manifest, staging)
        if problem is None:
            bad = _not_finite(manifest, staging, tensors)
            if bad:
                problem = "non-finite values in " + ", ".join(bad[:5])
        if side.max([1 if problem else 0])[0]:  # (3)
            return problem or "another server rank could not stage the push"
        return tensors


def group_router(engine, submit, state: dict, security=None):
    """The ``/weights_group/*`` routes; ``submit(payload)`` queues a job between batches (the
    batcher's ``update`` jobs: ``Engine.update_weights`` runs it on every rank) -> a future;
    ``security``: its ``allowed_weight_peers`` (default: loopback only)."""
    from parallel_models.inference.server.security import ServerSecurity
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse
    from pydantic import ValidationError

    router = APIRouter()
    status = state.setdefault("weights_group", {"last": None})
    security = security or ServerSecurity()

    def _record(kind, push_id=None):
        def done(fut):
            status["joining"] = False
            exc = fut.exception()
            status["last"] = ({"kind": kind, "push_id": push_id, "ok": True, **fut.result()}
                              if exc is None else
                              {"kind": kind, "push_id": push_id, "ok": False, "error": f"{exc}"})
        return done

    def _error(status_code, message):
        return JSONResponse({"error": message}, status_code)

    async def _body(request, model_cls):
        try:
            return model_cls.model_validate_json(await request.body())
        except ValidationError as exc:
            msgs = [f"{'.'.join(str(x) for x in e.get('loc', ())) or 'body'}: {e.get('msg')}"
                    for e in exc.errors()[:5]]
            raise _BadRequest("invalid request: " + "; ".join(msgs)) from None

    @router.post("/weights_group/init")
    async def init(request: Request):
        try:
            req = await _body(request, GroupInit)
        except _BadRequest as exc:
            return _error(400, str(exc))
        if req.world_size != 1 + engine.world:
            return _error(400, f"world_size {req.world_size}: the group is the trainer's rank 0 "
                               f"+ this server's {engine.world} rank(s) = {1 + engine.world}")
        if not security.peer_allowed(req.master_addr, req.master_port):
            return _error(403, f"master_addr {req.master_addr}:{req.master_port} is not an "
                               "allowed weights peer: start the server with "
                               "--allowed-weight-peers HOST[:PORT] (default: loopback only)")
        status["joining"] = True  # a push may be queued behind the join (the queue is FIFO)

        def started(fut):  # the join runs on every rank's own thread: record how it ends
            pending = getattr(engine, "pending_join", None)
            if fut.exception() is not None or pending is None:
                return _record("join")(fut)
            pending.on_settled(_record_join)

        submit(JoinJob(req.model_dump())).add_done_callback(started)
        return JSONResponse({"status": "joining", "world_size": req.world_size}, 202)

    def _record_join(outcome: dict):
        status["joining"] = False
        status["last"] = ({"kind": "join", "push_id": None, "ok": True, **outcome}
                          if "error" not in outcome else
                          {"kind": "join", "push_id": None, "ok": False, **outcome})

    @router.post("/weights_group/update")
    async def update(request: Request):
        try:
            manifest = await _body(request, Manifest)
            check_manifest(manifest, engine.model)
        except (_BadRequest, WeightStreamError) as exc:
            return _error(400, f"weight push rejected, version {engine.version} kept: {exc}")
        if getattr(engine, "weight_group", None) is None and not status.get("joining"):
            return _error(409, "no weights group joined: POST /weights_group/init first")
        submit(PushJob(manifest.model_dump())).add_done_callback(_record("push", manifest.push_id))
        return JSONResponse({"status": "receiving"}, 202)

    @router.get("/weights_group/status")
    async def get_status():
        side = getattr(engine, "weight_group", None)
        return {"joined": side is not None, "joining": bool(status.get("joining")),
                "transport": getattr(side, "transport", None),
                "weight_version": engine.version, "last": status["last"],
                "last_push": getattr(engine, "last_group_push", None)}

    return router


class _BadRequest(ValueError):
    pass


__all__ = ["GroupInit", "JoinJob", "Manifest", "PushJob", "check_manifest", "drop_group",
           "group_router"]
