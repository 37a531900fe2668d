"""The torch record format: one ``torch.save`` d tensor, a ZIP_STORED zip archive (``data.pkl``,
the storages under ``data/``, a few small members). torch DCP stores every chunk of a
``.distcp`` file as one such record.

- Decoding (:func:`decode_torch_record`, :func:`record_data_start`): the pickle is read by
  torch's weights-only unpickler, exactly as ``torch.load(weights_only=True)`` does, and the
  storages are views of the record's bytes (no copy) or, when only the layout is wanted, memory
  never touched.
- Encoding (:func:`encode_record`): the record ``torch.save`` writes for a tensor, with the
  tensor's data left out, to be streamed in by the caller (copied from a tensor, or read
  straight from source files). Every zip member carries its CRC32: the small members' are
  computed here; the data member's is computed by the writer thread while it writes the data
  (:class:`RecordLayout.data_crc_at` says where it goes). The records differ from
  ``torch.save``'s only in ``.data/serialization_id`` (torch derives it from the CRCs it
  combined; ours is the one torch writes with CRC32 off); ``torch.load`` does not read it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import mmap
import struct
import sys
import zipfile
import zlib
from typing import Any, Callable

import numpy
import torch


class _MemFile(io.RawIOBase):
    """A seekable read-only file over byte pieces of a record: ``{start: memoryview}`` (one piece
    at 0 for a whole record; a head and a tail when only those were read). zipfile reads a
    record's directory through it; reading bytes that are not held raises ValueError."""

    def __init__(self, buf, length: int | None = None):
        pieces = buf if isinstance(buf, dict) else {0: buf}
        self.pieces = sorted((start, memoryview(p).cast("B")) for start, p in pieces.items())
        self.length = (max(s + len(p) for s, p in self.pieces) if length is None else length)
        self.pos = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), self.length - self.pos))
        if n:
            for start, piece in self.pieces:
                if start <= self.pos and self.pos + n <= start + len(piece):
                    b[:n] = piece[self.pos - start:self.pos - start + n]
                    break
            else:
                raise ValueError("record bytes not read")
        self.pos += n
        return n


def _unpickle_record(f: _MemFile, storage_for: Callable) -> Any:
    """Unpickle a ``torch.save`` record (a ZIP_STORED zip) with torch's weights-only unpickler.
    Member bytes are located through the zip directory and read without CRC checks (records
    written with ``torch.serialization.set_crc32_options(False)`` have none; torch.load does not
    check them either). ``storage_for(start, nbytes, dtype)`` returns the storage of the data
    member at ``start``."""
    from torch import _weights_only_unpickler

    zf = zipfile.ZipFile(f)
    names = set(zf.namelist())

    def member(name):  # (start, size) of a member's bytes
        info = zf.getinfo(name)
        f.seek(info.header_offset)
        head = f.read(30)
        if info.compress_type != zipfile.ZIP_STORED or head[:4] != b"PK\x03\x04":
            raise ValueError("record layout")
        name_len, extra_len = struct.unpack_from("<HH", head, 26)
        return info.header_offset + 30 + name_len + extra_len, info.file_size

    def read(name):
        start, size = member(name)
        f.seek(start)
        return f.read(size)

    pkl = next(n for n in names if n.endswith("/data.pkl"))
    prefix = pkl[: -len("data.pkl")]
    if prefix + "byteorder" in names and read(prefix + "byteorder").decode() != sys.byteorder:
        raise ValueError("byte order")

    def persistent_load(saved_id):
        typename, storage_type, key, _location, numel = saved_id
        if typename != "storage":
            raise ValueError(typename)
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        nbytes = numel * torch._utils._element_size(dtype)
        start, size = member(f"{prefix}data/{key}")
        if size != nbytes or start + nbytes > f.length:
            raise ValueError("record layout")
        return storage_for(start, nbytes, dtype)

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(read(pkl)), encoding="utf-8")
    unpickler.persistent_load = persistent_load
    return unpickler.load()


def decode_torch_record(raw: torch.Tensor) -> torch.Tensor:
    """A ``torch.save`` d tensor (one DCP chunk) from its bytes (a uint8 tensor), without copying
    its data: the storages are views of ``raw`` (ZIP_STORED records), built by torch's
    weights-only unpickler exactly as ``torch.load`` builds them. Anything unusual falls back to
    ``torch.load(weights_only=True)``."""
    mem = memoryview(raw.numpy())
    storage = raw.untyped_storage()
    try:
        def view(start, nbytes, dtype):  # a storage over the record's bytes: no copy
            return torch.storage.TypedStorage(wrap_storage=storage[start:start + nbytes],
                                              dtype=dtype, _internal=True)

        out = _unpickle_record(_MemFile(mem), view)
        if isinstance(out, torch.Tensor):
            return out
    except Exception:  # noqa: BLE001 - the slow, general path below decides
        pass
    return torch.load(io.BytesIO(mem.tobytes()), map_location="cpu", weights_only=True)


def record_data_start(head, tail, length: int, dtype: torch.dtype, shape) -> int | None:
    """Where, in a ``torch.save`` record of ``length`` bytes of which only ``head`` (its first
    bytes) and ``tail`` (its last) were read, the data of the tensor it holds starts, if that
    tensor is ``shape`` / ``dtype``, contiguous, over one storage; else None (decode it whole)."""
    starts = []

    def storage_for(start, nbytes, dt):  # a storage without memory: only the layout is wanted
        starts.append(start)
        return torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(nbytes, device="meta"),
                                          dtype=dt, _internal=True)

    try:
        t = _unpickle_record(_MemFile({0: head, length - len(tail): tail}, length), storage_for)
    except Exception:  # noqa: BLE001 - unusual record: the general path reads it
        return None
    if (not isinstance(t, torch.Tensor) or len(starts) != 1 or t.dtype != dtype
            or tuple(t.shape) != tuple(shape) or not t.is_contiguous()):
        return None
    return starts[0] + t.storage_offset() * t.element_size()


@contextlib.contextmanager
def _no_crc32():
    """torch.save without its own CRC32 pass (the CRCs are filled in by :func:`encode_record` and
    the writer thread): scoped, the previous setting is restored."""
    prev = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(prev)


@dataclasses.dataclass
class RecordLayout:
    """A ``torch.save`` record of one tensor without its data: ``head`` (the bytes before the
    data), ``nbytes`` of data, then ``tail``. ``data_crc_at``: offsets, from the record's start,
    of the two CRC32 fields of the data member (its local header, its central directory entry),
    to be filled with the CRC32 of the data."""

    head: bytes
    nbytes: int
    tail: bytes
    data_crc_at: tuple[int, ...]


class _CaptureSink:
    """What ``torch.save`` writes to: keeps its bytes except the data of ``tensor`` (one write of
    exactly its bytes from its memory), whose place is remembered."""

    def __init__(self, tensor: torch.Tensor):
        self.ptr = tensor.data_ptr()
        self.nbytes = tensor.untyped_storage().nbytes()
        self.head = bytearray()
        self.tail: bytearray | None = None

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        if (self.tail is None and self.nbytes and len(mv) == self.nbytes
                and numpy.frombuffer(mv, dtype=numpy.uint8).ctypes.data == self.ptr):
            self.tail = bytearray()
        elif self.tail is None:
            self.head += mv
        else:
            self.tail += mv
        return len(mv)

    def flush(self) -> None:
        pass


def _members(raw: "_MemFile") -> list[tuple[int, int, tuple[int, int]]]:
    """(data start, size, (offset of its CRC32 before the central directory, offset of its CRC32
    in the central directory)) of every member. The first is in the data descriptor after the
    data when the member has one (torch's writer does), else in the local header."""
    zf = zipfile.ZipFile(raw)
    out = []
    pos = zf.start_dir
    for info in zf.infolist():
        raw.seek(pos)
        cd = raw.read(46)
        if cd[:4] != b"PK\x01\x02":
            raise ValueError("unexpected zip central directory")
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", cd, 28)
        raw.seek(info.header_offset)
        local = raw.read(30)
        flags, = struct.unpack_from("<H", local, 6)
        lname, lextra = struct.unpack_from("<HH", local, 26)
        start = info.header_offset + 30 + lname + lextra
        first = info.header_offset + 14
        if flags & 0x08:  # a data descriptor follows the data, with or without its signature
            raw.seek(start + info.file_size)
            first = start + info.file_size + (4 if raw.read(4) == b"PK\x07\x08" else 0)
        out.append((start, info.file_size, (first, pos + 16)))
        pos += 46 + name_len + extra_len + comment_len
    return out


def encode_record(tensor: torch.Tensor) -> RecordLayout:
    """The record ``torch.save(tensor)`` writes, as head / data / tail with every CRC32 but the
    data's filled in. ``tensor`` may be a placeholder over untouched memory: only its shape,
    dtype and address are used (its storage must be exactly the tensor, as DCP hands tensors to
    torch.save)."""
    sink = _CaptureSink(tensor)
    with _no_crc32():
        torch.save(tensor, sink)
    nbytes = sink.nbytes
    if nbytes and sink.tail is None:
        raise ValueError("torch.save did not write the tensor data in one piece")
    head, tail = sink.head, sink.tail if sink.tail is not None else bytearray()
    if not nbytes:
        head, tail = head + tail, bytearray()
    length = len(head) + nbytes + len(tail)
    raw = _MemFile({0: head, len(head) + nbytes: tail} if tail else {0: head}, length)
    data_crc_at: tuple[int, ...] = ()
    for start, size, crc_at in _members(raw):
        if nbytes and start == len(head) and size == nbytes:
            if min(crc_at) < len(head):
                raise ValueError("the data member's CRC32 field precedes its data")
            data_crc_at = crc_at
            continue
        buf, base = (head, 0) if start + size <= len(head) else (tail, len(head) + nbytes)
        crc = struct.pack("<I", zlib.crc32(buf[start - base:start - base + size]))
        for at in crc_at:
            target, off = (head, at) if at < len(head) else (tail, at - len(head) - nbytes)
            target[off:off + 4] = crc
    if nbytes and not data_crc_at:
        raise ValueError("tensor data member not found in the record")
    return RecordLayout(bytes(head), nbytes, bytes(tail), data_crc_at)


class Placeholder:
    """Tensors of any shape / dtype over reserved but never touched memory (no RSS): what
    :func:`encode_record` is given when the data itself is copied from the source files."""

    def __init__(self):
        self._mem = None

    def tensor(self, sizes, dtype: torch.dtype) -> torch.Tensor:
        numel = int(torch.Size(sizes).numel())
        nbytes = numel * dtype.itemsize
        if not numel:
            return torch.empty(sizes, dtype=dtype)
        if self._mem is None or len(self._mem) < nbytes:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
            self._mem = mmap.mmap(-1, max(nbytes, 4096), flags=flags)
        # storage of exactly the tensor's size, offset 0: as DCP hands tensors to torch.save
        return torch.frombuffer(self._mem, dtype=dtype, count=numel).view(sizes)
