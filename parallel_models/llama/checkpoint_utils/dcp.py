"""torch distributed-checkpoint (DCP) files: reading the ``.metadata`` index safely and writing a
checkpoint from a plan of chunks in one process.

- :func:`read_dcp_metadata`: the ``.metadata`` pickle through an allow-list unpickler (only DCP's
  own dataclasses, ``torch.Size`` and dtypes), so a crafted checkpoint cannot run code. torch's
  weights-only unpickler (``torch.serialization.safe_globals``) would be the natural tool, but it
  reads pickle protocol 2 only and DCP writes its index with the highest protocol (torch 2.13:
  "Unsupported operand 149", the FRAME opcode), so it does not serve here.
- :func:`write_dist_checkpoint`: torch DCP's planner, ``.metadata`` and file names, with the
  ``.distcp`` files written by us: each chunk is the record ``torch.save`` writes
  (``torch_record.encode_record``), its data produced on demand or copied verbatim from byte
  ranges of files, streamed through ``direct_io.WriteBehind`` (reused buffers, O_DIRECT,
  write-behind fsync), its CRC32 computed on the write-behind thread.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import threading
import warnings
from typing import Callable

import torch

from parallel_models.llama.checkpoint_utils.direct_io import (RangeReader, StreamFile,
                                                             WriteBehind, segment_filler)
from parallel_models.llama.checkpoint_utils.errors import CheckpointError
from parallel_models.llama.checkpoint_utils.torch_record import Placeholder, encode_record

DCP_METADATA = ".metadata"  # torch DCP's index


_ALLOWED_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem",
        "LoadItemType", "BytesIOWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "getattr"},
    "uuid": {"UUID"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch DCP ``.metadata`` allowing only its own dataclasses, torch.Size and dtypes:
    a crafted checkpoint cannot run code through it."""

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED_GLOBALS.get(module, ()):
            if module == "builtins" and name == "getattr":
                return _safe_getattr
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")


def _safe_getattr(obj, name):
    if not isinstance(obj, type) or obj.__module__.split(".")[0] != "torch":
        raise pickle.UnpicklingError("getattr is only allowed on torch classes")
    return getattr(obj, name)


def read_dcp_metadata(folder: str):
    path = os.path.join(folder, DCP_METADATA)
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder}: no {DCP_METADATA} (not a torch_dist checkpoint, or its "
                              "save did not finish)")
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as err:
        raise CheckpointError(f"{path}: cannot read checkpoint metadata ({err})") from err


@dataclasses.dataclass
class ChunkItem:
    """One chunk to write: ``resolve()`` returns its data (shape ``sizes``) when it is written.
    ``segments``, when given, are instead its bytes as ``(file, offset, length)`` ranges of files,
    in order (already ``dtype``, nothing to transform): they are copied straight from the files
    into the output buffers, without building the tensor."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    resolve: Callable[[], torch.Tensor]
    segments: list[tuple[str, int, int]] | None = None

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.sizes).numel()) * self.dtype.itemsize


def _save_planner(items: list[ChunkItem], objects: list[tuple[str, bytes]]):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties)
    from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                      WriteItemType)

    class LazyPlanner(DefaultSavePlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.resolvers: dict[MetadataIndex, tuple] = {}
            self.write_items = []
            for it in items:
                index = MetadataIndex(it.key, torch.Size(it.offsets))
                self.write_items.append(WriteItem(
                    index=index, type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(it.offsets),
                                                   sizes=torch.Size(it.sizes)),
                        properties=TensorProperties(dtype=it.dtype),
                        size=torch.Size(it.global_shape))))
                self.resolvers[index] = (it, it.resolve)
            for key, raw in objects:
                index = MetadataIndex(key)
                self.write_items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
                self.resolvers[index] = (None, lambda raw=raw: io.BytesIO(raw))

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=True):
            self.state_dict = {}
            self.is_coordinator = is_coordinator

        def create_local_plan(self):
            self.plan = SavePlan(self.write_items)
            return self.plan

        def resolve_data(self, write_item):
            it, fn = self.resolvers[write_item.index]
            data = fn()
            if it is not None:
                if tuple(data.shape) != tuple(it.sizes):
                    raise CheckpointError(f"internal: {it.key} at {it.offsets}: produced shape "
                                          f"{tuple(data.shape)}, planned {it.sizes}")
                data = data.to(it.dtype).contiguous()
            return data

    return LazyPlanner()


def write_record(out: StreamFile, tensor: torch.Tensor,
                 produce: Callable[[memoryview, int], None]) -> None:
    """Append to ``out`` the record ``torch.save(tensor)`` writes, its data made by ``produce``
    (a ``StreamFile.fill`` producer; ``tensor`` may be a placeholder) and its CRC32 computed and
    placed by the write-behind thread."""
    layout = encode_record(tensor)
    start = out.tell()
    out.write(layout.head)
    if layout.nbytes:
        out.fill(layout.nbytes, produce, crc_at=tuple(start + a for a in layout.data_crc_at))
    out.write(layout.tail)


def tensor_filler(tensor: torch.Tensor) -> Callable[[memoryview, int], None]:
    """A ``StreamFile.fill`` producer copying a (contiguous) tensor's bytes."""
    src = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())

    def produce(dst: memoryview, done: int) -> None:
        dst[:] = src[done:done + len(dst)]

    return produce


def _direct_writer(folder: str, bucket_bytes: int, threads: int, on_item=None,
                   stats: dict | None = None):
    """torch DCP's FileSystemWriter (its plan, ``.metadata`` and file names), writing the
    ``.distcp`` files itself: each chunk is the ``torch.save`` record DCP writes (with CRC32s),
    streamed through a :class:`WriteBehind`, the data of chunks with ``segments`` read
    straight from their files into its buffers. Chunks go in plan order into files of about
    ``bucket_bytes``; ``threads`` files are written at a time (each thread with its buffers)."""
    import concurrent.futures

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    resolve_lock = threading.Lock()  # resolve() reads through shared file handles
    stats = {"direct_read_bytes": 0, "crc_seconds": 0.0, "crc_bytes": 0} if stats is None else stats

    def write_file(planner, out: StreamFile, name: str, bucket, reader: RangeReader,
                   placeholder: Placeholder) -> list:
        results = []
        # DCP's order within a file: the byte objects, then the tensors
        for item in sorted(bucket, key=lambda wi: wi.type != WriteItemType.BYTE_IO):
            offset = out.tell()
            if item.type == WriteItemType.BYTE_IO:
                out.write(planner.resolve_data(item).getbuffer())
            else:
                it, _ = planner.resolvers[item.index]
                if it.segments is not None and it.nbytes:
                    if sum(n for _, _, n in it.segments) != it.nbytes:
                        raise CheckpointError(f"internal: {it.key} at {it.offsets}: segments "
                                              f"hold the wrong number of bytes")
                    write_record(out, placeholder.tensor(it.sizes, it.dtype),
                                 segment_filler(reader, it.segments))
                else:
                    with resolve_lock:
                        data = planner.resolve_data(item)
                    if data.untyped_storage().nbytes() != data.nbytes:  # as DCP: only the chunk
                        data = data.clone()
                    write_record(out, data, tensor_filler(data))
                if on_item is not None:
                    on_item(it, it.nbytes)
            length = out.tell() - offset
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(name, offset, length)))
        return results

    def write_files(planner, jobs) -> list:
        wb, reader, placeholder = WriteBehind(), RangeReader(), Placeholder()
        out, results = None, []
        try:
            for path, name, bucket in jobs:
                out = wb.open(path)
                results += write_file(planner, out, name, bucket, reader, placeholder)
                out.close()
                out = None
            wb.finish()
        except BaseException:
            if out is not None:
                out.abort()
            wb.abort()
            raise
        finally:
            reader.close()
            with resolve_lock:
                stats["direct_read_bytes"] += reader.direct_bytes
                stats["crc_seconds"] += wb.crc_seconds
                stats["crc_bytes"] += wb.crc_bytes
        return results

    def chunk_bytes(item):  # (torch's _item_size counts the whole tensor, not the chunk)
        td = item.tensor_data
        return int(torch.Size(td.chunk.sizes).numel()) * torch.empty(
            (), dtype=td.properties.dtype).element_size()

    class DirectWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            buckets, current, size = [], [], 0
            for item in plan.items:
                n = 0 if item.type == WriteItemType.BYTE_IO else chunk_bytes(item)
                if current and size + n > bucket_bytes:
                    buckets.append(current)
                    current, size = [], 0
                current.append(item)
                size += n
            if current:
                buckets.append(current)
            jobs = []
            for i, bucket in enumerate(buckets):
                name = f"{plan.storage_data.prefix}{i}{DEFAULT_SUFFIX}"
                jobs.append((str(self.fs.concat_path(self.path, name)), name, bucket))
            n = max(1, min(threads, len(jobs)))
            if n == 1:
                results = write_files(planner, jobs)
            else:
                with concurrent.futures.ThreadPoolExecutor(n) as pool:
                    parts = [pool.submit(write_files, planner, jobs[k::n]) for k in range(n)]
                    results = [r for p in parts for r in p.result()]
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(results)
            return fut

    return DirectWriter(folder, single_file_per_rank=True, sync_files=True,
                        thread_count=1, overwrite=True)


def write_dist_checkpoint(folder: str, items: list[ChunkItem], objects: list[tuple[str, bytes]],
                          *, threads: int = 1, on_item=None) -> dict:
    """Write a megatron-core ``torch_dist`` checkpoint into the (new, empty) ``folder`` from
    ``items``, each resolved (or its segments read) only when its turn comes, into files of
    about the largest chunk (at least 256 MiB); memory stays at one resolved chunk plus the
    stream buffers per writer thread. ``on_item(item, nbytes)`` after each chunk. Every file is
    fsynced. Returns ``{"direct_read_bytes"}`` (segment bytes that were not in the page cache),
    ``{"crc_seconds", "crc_bytes"}`` (CRC32 work of the write-behind threads)."""
    import torch.distributed.checkpoint as dcp

    planner = _save_planner(items, objects)
    largest = max((it.nbytes for it in items), default=0)
    stats = {"direct_read_bytes": 0, "crc_seconds": 0.0, "crc_bytes": 0}
    writer = _direct_writer(folder, max(largest, 256 * 2**20), threads, on_item, stats)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
    except CheckpointException as err:  # DCP wraps what went wrong: raise that (clear message)
        for exc, _trace in err.failures.values():
            if isinstance(exc, BaseException):
                raise exc from None
        raise
    return stats
