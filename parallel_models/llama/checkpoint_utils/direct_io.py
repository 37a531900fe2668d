"""Direct, streaming file I/O for the converters: reused aligned buffers, O_DIRECT writes on a
write-behind thread, reads that take the page cache when the bytes are there and O_DIRECT when not.

Why: converting a checkpoint copies bytes, and copying within memory that is already mapped is
cheap (> 10 GB/s); what costs is fresh memory: every page-cache page a buffered write or read
creates, and every newly allocated tensor, is a page fault / page allocation (about 1 GB/s on a
VM, where page faults are expensive). So the converters stream through a few buffers faulted in
once and reused; they write them with O_DIRECT (from our buffer to the device, no page cache) on
a background thread while the next buffer is filled, and read with O_DIRECT what is not in the
page cache already.

The write-behind thread also computes CRC32s of byte ranges the caller marks (``fill(...,
crc_at=...)``) and writes them at the offsets given, later in the same file (torch records carry
the CRC32 of their data after it), off the filling thread. With ISA-L's CRC32 (``isal``, ~35 GB/s
here) that pass costs little; zlib's (~6 GB/s, ~3 GB/s on a loaded 2-core VM) halved hf2mcore's
throughput there.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import mmap
import os
import queue
import struct
import threading
import time
from typing import Any, Callable

try:  # ISA-L's CRC32 (PCLMUL) is ~6x zlib's; same polynomial and values
    from isal.isal_zlib import crc32
except ImportError:  # platforms without an isal wheel
    from zlib import crc32

from parallel_models.llama.checkpoint_utils.errors import CheckpointError

_ALIGN = 4096  # O_DIRECT offset / length / address alignment every Linux block device accepts
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def _prefaulted_buffer(nbytes: int) -> memoryview:
    """Anonymous page-aligned memory, faulted in now, once (MAP_POPULATE)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return memoryview(mmap.mmap(-1, max(nbytes, _ALIGN), flags=flags))


def _open_direct(path: str, flags: int) -> tuple[int, bool]:
    """An fd with O_DIRECT when the file system supports it (else a plain one)."""
    if _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, 0o644), True
        except OSError as err:
            if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return os.open(path, flags, 0o644), False


def _clear_direct(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    while len(mv):
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n


class WriteBehind:
    """Files written through ``count`` reused buffers of ``size`` bytes: the caller fills one
    (:meth:`open` -> :class:`StreamFile`) while a background thread writes the full ones, then
    the file's tail, fsyncs and closes it (so a file's fsync overlaps the filling of the next).
    An error of the thread is raised by the caller's next call; :meth:`finish` waits for all."""

    def __init__(self, size: int = 32 << 20, count: int = 3):
        self.size = size - size % _ALIGN
        self._free: queue.Queue = queue.Queue()
        for _ in range(count):
            self._free.put(_prefaulted_buffer(self.size))
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._cancel = False
        self.crc_seconds = 0.0  # time the thread spent computing CRC32s
        self.crc_bytes = 0
        self._thread = threading.Thread(target=self._run, name="write-behind", daemon=True)
        self._thread.start()

    def open(self, path: str) -> "StreamFile":
        self._check()
        return StreamFile(self, path)

    def _run(self):
        while True:
            job = self._jobs.get()
            if job is None:
                return
            sf, buf, offset, n, last, regions = job
            try:
                if not self._cancel and self._error is None:
                    sf._write(buf[:n], offset, last, regions)
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                self._error = err
            finally:
                if last:
                    os.close(sf.fd)
                self._free.put(buf)

    def _check(self):
        if self._error is not None:
            err, self._error = self._error, None
            self._cancel = True  # what is queued after a failure is not written
            raise err

    def _submit(self, job) -> None:
        self._check()
        self._jobs.put(job)

    def _take(self) -> memoryview:
        buf = self._free.get()
        self._check()
        return buf

    def finish(self) -> None:
        """Wait until every file is written, fsynced and closed; raise the first error."""
        self._jobs.put(None)
        self._thread.join()
        self._check()

    def abort(self) -> None:
        """Stop writing (queued data is dropped), close the files; for error paths."""
        self._cancel = True
        self._jobs.put(None)
        self._thread.join()


class StreamFile:
    """One file written sequentially through a :class:`WriteBehind` (see there)."""

    def __init__(self, wb: WriteBehind, path: str):
        self.wb = wb
        self.path = path
        self.fd, self.direct = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self.pos = 0       # bytes written so far = file offset of the next byte
        self._base = 0     # file offset of the buffer's first byte
        self._fill = 0
        self._buf = wb._take()
        self._new_regions: list[tuple[int, int, tuple[int, ...]]] = []  # caller side
        self._regions: list[list] = []    # write-behind thread: [start, end, crc, crc_at]
        self._patches: list[tuple[int, bytes]] = []  # write-behind thread: (offset, bytes)

    def tell(self) -> int:
        return self.pos

    def write(self, data) -> int:
        """Copy ``data`` (bytes-like) into the file."""
        mv = memoryview(data).cast("B")

        def copy(dst: memoryview, done: int) -> None:
            dst[:] = mv[done:done + len(dst)]

        return self.fill(len(mv), copy)

    def fill(self, n: int, produce: Callable[[memoryview, int], Any],
             crc_at: tuple[int, ...] = ()) -> int:
        """Append ``n`` bytes that ``produce(dst, done)`` writes into ``dst`` (a piece of the
        buffer; ``done`` = bytes of the ``n`` produced before): e.g. read from a source file
        straight into the buffer. ``crc_at``: file offsets, after these bytes, where the
        write-behind thread puts their CRC32 (4 bytes, little-endian) once it has seen them."""
        if crc_at:
            if min(crc_at) < self.pos + n:
                raise ValueError(f"{self.path}: a CRC32 goes after its bytes, not at "
                                 f"{min(crc_at)} (bytes {self.pos}:{self.pos + n})")
            self._new_regions.append((self.pos, self.pos + n, tuple(crc_at)))
        done = 0
        while done < n:
            k = min(n - done, self.wb.size - self._fill)
            produce(self._buf[self._fill:self._fill + k], done)
            done += k
            self._fill += k
            self.pos += k
            if self._fill == self.wb.size:
                self._submit(False)
                self._base += self._fill
                self._fill = 0
                self._buf = self.wb._take()
        return n

    def _submit(self, last: bool) -> None:
        regions, self._new_regions = self._new_regions, []
        self.wb._submit((self, self._buf, self._base, self._fill, last, regions))

    def close(self) -> None:
        """Queue the tail, fsync and close (done on the background thread)."""
        self._submit(True)
        self._buf = None

    def abort(self) -> None:
        if self._buf is not None:
            buf, self._buf = self._buf, None
            self.wb._cancel = True
            self.wb._jobs.put((self, buf, self._base, 0, True, []))

    def _checksum(self, mv: memoryview, offset: int, regions) -> None:  # background thread
        """CRC32 of the marked regions in ``mv`` (file offset ``offset``); the finished ones'
        CRCs become patches, applied to ``mv`` where they fall in it."""
        end = offset + len(mv)
        if regions or self._regions:
            t0 = time.perf_counter()
            self._regions += [[a, b, 0, at] for a, b, at in regions]
            for r in list(self._regions):
                a, b = max(r[0], offset), min(r[1], end)
                if a < b:
                    r[2] = crc32(mv[a - offset:b - offset], r[2])
                    self.wb.crc_bytes += b - a
                if r[1] <= end:
                    self._regions.remove(r)
                    self._patches += [(at, struct.pack("<I", r[2])) for at in r[3]]
            self.wb.crc_seconds += time.perf_counter() - t0
        keep = []
        for at, data in self._patches:
            a, b = max(at, offset), min(at + len(data), end)
            if a < b:
                mv[a - offset:b - offset] = data[a - at:b - at]
            if at + len(data) > end:
                keep.append((at, data))
        self._patches = keep

    def _write(self, mv: memoryview, offset: int, last: bool, regions=()) -> None:  # background
        self._checksum(mv, offset, regions)
        if last and (self._patches or self._regions):
            raise CheckpointError(f"internal: {self.path}: a CRC32 falls beyond the file's end")
        if self.direct:
            aligned = len(mv) - len(mv) % _ALIGN
            try:
                _pwrite_all(self.fd, mv[:aligned], offset)
            except OSError as err:  # a file system with other O_DIRECT rules: write buffered
                if err.errno != errno.EINVAL:
                    raise
                self.direct = False
                _clear_direct(self.fd)
                _pwrite_all(self.fd, mv[:aligned], offset)
            mv, offset = mv[aligned:], offset + aligned
            if len(mv):  # the unaligned end of the file (last buffer only): written buffered
                self.direct = False
                _clear_direct(self.fd)
        _pwrite_all(self.fd, mv, offset)
        if last:
            os.fsync(self.fd)


class RangeReader:
    """Reads byte ranges of files into given buffers. A file is read with plain reads that may
    not wait for the disk (RWF_NOWAIT) while its bytes are in the page cache; once they are not,
    with O_DIRECT through one aligned bounce buffer: large reads straight from the device, no
    page cache filled. File systems without RWF_NOWAIT (tmpfs) get plain reads. One per
    thread."""

    def __init__(self, bounce: int = 16 << 20):
        self._files: dict[str, list] = {}  # path -> [fd, O_DIRECT fd or None, mode]
        self._bounce_size = bounce
        self._bounce: memoryview | None = None
        self._window = ("", 0, 0)  # (path, file offset, length) of what the bounce buffer holds
        self.direct_bytes = 0  # bytes read with O_DIRECT (not in the page cache)

    def read_into(self, path: str, offset: int, dst) -> None:
        mv = memoryview(dst).cast("B")
        entry = self._files.get(path)
        fresh = entry is None
        if fresh:
            entry = self._files[path] = [os.open(path, os.O_RDONLY), None,
                                         "cache" if _RWF_NOWAIT else "plain"]
        got, probe = 0, fresh
        if entry[2] == "cache":
            try:
                while got < len(mv):
                    # a file's first read is small: a miss starts a readahead of its size
                    piece = mv[got:got + (65536 if probe else len(mv))]
                    n = os.preadv(entry[0], [piece], offset + got, _RWF_NOWAIT)
                    probe = False
                    if n == 0:
                        _eof(path, offset + got, offset + len(mv))
                    got += n
            except BlockingIOError:  # not (all) in the page cache: the rest from the device
                if entry[1] is None:
                    entry[1], direct = _open_direct(path, os.O_RDONLY)
                    if not direct:
                        os.close(entry[1])
                        entry[1], entry[2] = None, "plain"
                if got == 0 and entry[2] == "cache":  # and so the rest of this file
                    entry[2] = "direct"
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                entry[2] = "plain"  # no RWF_NOWAIT on this file system
        pos, end = offset + got, offset + len(mv)
        if entry[1] is not None and entry[2] != "plain":
            self.direct_bytes += end - pos
        while pos < end:
            if entry[1] is not None and entry[2] != "plain":
                wpath, w0, wn = self._window
                if wpath != path or not w0 <= pos < w0 + wn:  # (else: read before, in memory)
                    if self._bounce is None:
                        self._bounce = _prefaulted_buffer(self._bounce_size)
                    w0 = pos - pos % _ALIGN
                    want = min(len(self._bounce), -(-end // _ALIGN) * _ALIGN - w0)
                    self._window = ("", 0, 0)  # (nothing valid if the read fails)
                    wn = os.preadv(entry[1], [self._bounce[:want]], w0)
                    self._window = (path, w0, wn)
                n = min(w0 + wn, end) - pos
                if n > 0:
                    mv[pos - offset:pos - offset + n] = self._bounce[pos - w0:pos - w0 + n]
            else:
                n = os.preadv(entry[0], [mv[pos - offset:]], pos)
            if n <= 0:
                _eof(path, pos, end)
            pos += n

    def close(self) -> None:
        for fd, dfd, _ in self._files.values():
            os.close(fd)
            if dfd is not None:
                os.close(dfd)
        self._files.clear()


def _eof(path: str, pos: int, end: int):
    raise CheckpointError(f"{path}: file ends at {pos}, inside data that ends at {end}")


def segment_filler(reader: RangeReader, segments: list[tuple[str, int, int]]) -> Callable:
    """A ``StreamFile.fill`` producer for the concatenation of byte ranges ``(file, offset,
    length)`` of files: each piece of the buffer is read straight from them."""
    starts = [0]
    for _, _, n in segments:
        starts.append(starts[-1] + n)

    def produce(dst: memoryview, done: int) -> None:
        end, at = done + len(dst), done
        i = bisect.bisect_right(starts, at) - 1
        while at < end:
            path, offset, n = segments[i]
            k = min(starts[i + 1], end) - at
            reader.read_into(path, offset + at - starts[i], dst[at - done:at - done + k])
            at += k
            i += 1

    return produce
