"""A process group beside both sides' own: trainer rank 0 + every rollout-server rank.

The trainer and the server each run their own ``torch.distributed`` world (or none); the weights
group joins them without touching either: a ``TCPStore`` the trainer hosts, and process groups
built directly on it (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` constructed by hand, as vLLM's
``stateless_init_torch_distributed_process_group`` and SGLang's ``init_weights_update_group``
do), never registered with ``torch.distributed``. So ``dist.broadcast(..., group=...)`` cannot be
used (it maps the root through the default group's global ranks); the collectives are the
backend objects' own (``pg.broadcast([t], opts)``, ranks local to this group), each with a
timeout, so a dead or stuck peer raises instead of hanging.

Ranks: 0 is the trainer, 1 + r is server rank r. Transport (:func:`pick_transport`, the same
answer on every member from the descriptors all of them exchange): ``gloo`` when a side is on
the CPU; ``nccl`` when all are on CUDA and no server rank shares the trainer's GPU; ``ipc``
(CUDA IPC handles, ``cuda_ipc.py``; gloo carries only the handshakes) when every server rank is
on the trainer's GPU (NCCL cannot join two processes on one device); ``gloo`` otherwise (some
server ranks on the trainer's GPU, some not). The gloo group always exists (control messages).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os

import torch
import torch.distributed as dist

TRANSPORTS = ("auto", "gloo", "nccl", "ipc")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def device_descriptor(device: torch.device) -> list[int]:
    """``[is_cuda, uuid hash high, uuid hash low]``: what the members exchange to pick the
    transport (the GPU's UUID, so two processes with different ``CUDA_VISIBLE_DEVICES`` agree)."""
    if device.type != "cuda":
        return [0, 0, 0]
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    digest = hashlib.sha1(uuid.encode()).digest()
    return [1, int.from_bytes(digest[:7], "little"), int.from_bytes(digest[7:14], "little")]


def pick_transport(descriptors: list[list[int]], wanted: str = "auto") -> str:
    """The transport for members with these descriptors (trainer first); ``wanted`` != auto
    forces one (refused where it cannot work)."""
    trainer, servers = descriptors[0], descriptors[1:]
    all_cuda = all(d[0] for d in descriptors)
    shared = [d[1:] == trainer[1:] for d in servers]
    auto = ("gloo" if not all_cuda else "ipc" if all(shared) else
            "nccl" if not any(shared) else "gloo")
    if wanted == "auto":
        return auto
    if wanted == "nccl" and (not all_cuda or any(shared)):
        raise ValueError("transport nccl needs every member on CUDA, no two on one GPU")
    if wanted == "ipc" and auto != "ipc":
        raise ValueError("transport ipc needs every server rank on the trainer's GPU")
    return wanted


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class SideGroup:
    """``SideGroup(master_addr, master_port, rank, world_size, device, timeout_s, wanted,
    store=None)``: join (rank 0, the trainer, hosts the ``TCPStore``; pass ``store`` when it
    was made first) and exchange descriptors; :attr:`transport` is then the same on every
    member (``wanted`` != auto forces one)."""

    def __init__(self, master_addr: str, master_port: int, rank: int, world_size: int,
                 device: torch.device, timeout_s: float, wanted: str = "auto", store=None):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = store or dist.TCPStore(master_addr, master_port, world_size, rank == 0,
                                            self.timeout, wait_for_workers=False)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = self.timeout
        # listen on the interface that reaches the master (loopback stays loopback)
        hostname = ("127.0.0.1" if master_addr in LOOPBACK else master_addr if rank == 0
                    else None)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname) if hostname
                         else dist.ProcessGroupGloo.create_default_device()]
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("weights/gloo", self.store), rank,
                                          world_size, opts)
        self.nccl = None
        mine = torch.tensor([device_descriptor(self.device)], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(world_size)]
        self._wait(self.gloo.allgather([every], [mine]))
        self.descriptors = [t[0].tolist() for t in every]
        self.transport = pick_transport(self.descriptors, wanted)
        if self.transport == "nccl":
            self._join_nccl()

    def _wait(self, work) -> None:
        if not work.wait(self.timeout):
            raise TimeoutError(f"weights group: no answer in {self.timeout.total_seconds():g} s")

    def _join_nccl(self) -> None:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self.timeout
        opts.is_high_priority_stream = False
        opts.global_ranks_in_group = list(range(self.world_size))  # (logs: no world to map to)
        opts.group_name = "weights_group"
        # blocking wait: a timed-out collective raises in wait() (the default watchdog would
        # tear the whole process down); read when the group is built, so set only around it
        with _env(TORCH_NCCL_BLOCKING_WAIT="1"):
            self.nccl = dist.ProcessGroupNCCL(dist.PrefixStore("weights/nccl", self.store),
                                              self.rank, self.world_size, opts)
        self.nccl._set_sequence_number_for_group()  # as torch's own group constructor does
        torch.cuda.set_device(self.device)
        probe = torch.ones(1, device=self.device)  # connect now, not in the first push
        self.broadcast(probe)

    # ---- collectives (ranks local to this group) ---------------------------------------------
    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """``tensor`` from ``root`` to every member, on NCCL when the group has it and the tensor
        is on CUDA, else on gloo."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = root, 0, self.timeout
        pg = self.nccl if self.nccl is not None and tensor.is_cuda else self.gloo
        self._wait(pg.broadcast([tensor], opts))

    def max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of ``values`` over the members (a vote: any non-zero
        flag wins; also how the server reports its new version)."""
        t = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp, opts.timeout = dist.ReduceOp.MAX, self.timeout
        self._wait(self.gloo.allreduce([t], opts))
        return t.tolist()

    def close(self) -> None:
        """Drop the group (its peers' next collective fails instead of waiting)."""
        for pg in (self.nccl, self.gloo):
            with contextlib.suppress(Exception):
                if pg is not None and hasattr(pg, "abort"):
                    pg.abort()
        self.nccl = self.gloo = None
        self.store = None


def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (loopback for a local server): where
    the server's ranks reach the trainer's store."""
    import socket

    if host in LOOPBACK:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


__all__ = ["SideGroup", "TRANSPORTS", "device_descriptor", "local_address_towards",
           "pick_transport"]
