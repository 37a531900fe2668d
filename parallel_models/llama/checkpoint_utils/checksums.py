"""Checksums of a checkpoint folder's files: ``checksums.json``, the size and CRC32 of every file.

Written by the trainer into each ``step_N`` folder (every file, once every rank has written its
files) and by ``hf2mcore`` / ``mcore2hf`` into their output folders (the tensor data files:
:data:`TENSOR_DATA`; the small text files stay editable); verified before anything is loaded by a
resume, by ``mcore2hf`` on its input and by the rollout server on a weight folder it is asked to
load, so flipped bits, truncated or zeroed data end in one error naming the file instead of a
changed run. CRC32 through ISA-L (``isal``, several GB/s; zlib's where no isal wheel exists).
Folders without ``checksums.json`` (saved before checksums existed, or by other tools) are read
unchecked.
"""

from __future__ import annotations

import json
import os

from parallel_models.llama.checkpoint_utils.direct_io import crc32  # ISA-L's, else zlib's

MANIFEST_FILE = "checksums.json"
FORMAT = "parallel_models.checksums/1"
_CHUNK = 16 << 20


class ChecksumMismatch(ValueError):
    """A checkpoint file differs from what was saved (names the file)."""


def file_crc32(path: str) -> int:
    value = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            value = crc32(view[:n], value)
    return value


def _files(folder: str) -> list[str]:
    out = []
    for root, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(p for p in out if p != MANIFEST_FILE)


#: the tensor data of a converter's output (what ``hf2mcore`` / ``mcore2hf`` record): the small
#: text files beside it (config.json, run_config.yaml, tokenizer files) stay editable by hand
TENSOR_DATA = (".distcp", ".safetensors")


def write_manifest(folder: str, suffixes: tuple[str, ...] | None = None) -> str:
    """Record the size and CRC32 of every file under ``folder`` (only those ending in one of
    ``suffixes`` when given); returns the manifest's path."""
    files = {rel: {"size": os.path.getsize(os.path.join(folder, rel)),
                   "crc32": f"{file_crc32(os.path.join(folder, rel)):08x}"}
             for rel in _files(folder) if suffixes is None or rel.endswith(suffixes)}
    path = os.path.join(folder, MANIFEST_FILE)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "algorithm": "crc32", "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def verify_manifest(folder: str) -> bool:
    """Check every file ``checksums.json`` lists (present, same size, same CRC32); raises
    :class:`ChecksumMismatch` naming the first file that differs. False when the folder has no
    manifest (nothing checked)."""
    path = os.path.join(folder, MANIFEST_FILE)
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        assert manifest.get("format") == FORMAT and isinstance(files, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as err:
        raise ChecksumMismatch(f"{path}: unreadable checksum file ({err})") from err
    for rel, want in files.items():
        file = os.path.join(folder, rel)
        if not os.path.isfile(file):
            raise ChecksumMismatch(f"{file}: missing (listed in {MANIFEST_FILE})")
        size = os.path.getsize(file)
        if size != want["size"]:
            raise ChecksumMismatch(f"{file}: truncated or rewritten ({size} bytes, "
                                   f"{want['size']} when saved)")
        got = f"{file_crc32(file):08x}"
        if got != want["crc32"]:
            raise ChecksumMismatch(f"{file}: corrupted (CRC32 {got}, {want['crc32']} when "
                                   "saved)")
    return True
