"""Atomic output folders: a checkpoint is written into a hidden sibling folder and renamed into
place at the end, so an interrupted save leaves no half folder behind."""

from __future__ import annotations

import os
import shutil
import uuid

from parallel_models.llama.checkpoint_utils.errors import CheckpointError


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
        self.tmp = temp_dir_for(path)

    def __enter__(self) -> str:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
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
