"""Atomic output folders: a checkpoint is written into a hidden sibling folder and renamed into
place at the end, so an interrupted save leaves no half folder behind. The hidden folders of
:class:`AtomicOutputDir` name their host and process (``.OUT.tmp-<host>-<pid>-<random>``); those of
processes that are gone (a killed ``hf2mcore`` / ``mcore2hf``) are removed by the next one that
writes into the same parent folder."""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import socket
import uuid

from parallel_models.llama.checkpoint_utils.errors import CheckpointError

logger = logging.getLogger(__name__)
_OWNED_TEMP = re.compile(r"^\..+\.tmp-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def check_output_dir(path: str, overwrite: bool = False) -> None:
    """Raise a CheckpointError if ``path`` cannot receive a new checkpoint (before any work)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: output path exists and is not a folder")
        if os.listdir(path) and not overwrite:
            raise CheckpointError(f"{path}: output folder exists and is not empty (nothing was "
                                  "written; choose a new path or remove it)")
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(parent) and not os.access(parent, os.W_OK):
        raise CheckpointError(f"{parent}: not writable")


def temp_dir_for(path: str, tag: str | None = None) -> str:
    """A hidden sibling of ``path`` on the same file system (so the final rename is atomic)."""
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path),
                        f".{os.path.basename(path)}.tmp-{tag or uuid.uuid4().hex[:12]}")


def _owner_tag() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def remove_stale_temp_dirs(parent: str) -> list[str]:
    """Remove the hidden temporary folders in ``parent`` left by :class:`AtomicOutputDir`s of
    processes of this host that no longer run; returns their paths (each logged)."""
    host, removed = socket.gethostname(), []
    for path in glob.glob(os.path.join(glob.escape(parent), ".*.tmp-*")):
        m = _OWNED_TEMP.match(os.path.basename(path))
        if m and m["host"] == host and not _alive(int(m["pid"])) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed %s, left by an interrupted save (process %s)", path, m["pid"])
            removed.append(path)
    return removed


def publish_dir(tmp: str, path: str, overwrite: bool = False) -> None:
    """Move the finished ``tmp`` folder to ``path`` (rename; an empty ``path`` is replaced)."""
    path = os.path.abspath(path)
    old = None
    if os.path.isdir(path):
        if not os.listdir(path):
            os.rmdir(path)
        elif overwrite:
            old = temp_dir_for(path, "old-" + uuid.uuid4().hex[:8])
            os.rename(path, old)
        else:
            raise CheckpointError(f"{path}: output folder appeared while writing; the result is "
                                  f"left in {tmp}")
    os.rename(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicOutputDir:
    """``with AtomicOutputDir(out) as tmp:`` write into ``tmp``; on success it becomes ``out``,
    on any error it is removed, so an interrupted save leaves no half folder behind."""

    def __init__(self, path: str, overwrite: bool = False):
        check_output_dir(path, overwrite)
        self.path = path
        self.overwrite = overwrite
        self.tmp = temp_dir_for(path, _owner_tag())

    def __enter__(self) -> str:
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        remove_stale_temp_dirs(parent)
        os.makedirs(self.tmp)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        try:
            publish_dir(self.tmp, self.path, self.overwrite)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        return False
