"""The HF checkpoint format: a folder of ``config.json`` + ``model*.safetensors`` (+
``model.safetensors.index.json``) as ``transformers`` writes and reads it.

- :func:`resolve_model_path`: a local folder, or an HF hub id fetched.
- :class:`SafetensorsCheckpoint`: lazy, slice-level reads (``safe_open(...).get_slice``), so a
  rank reads only what it owns.
- :class:`SafetensorsFileReader`: whole tensors read with ``readinto`` (no memory map), for
  streaming converters.
- :class:`ShardedSafetensorsWriter`: size-limited shards + index, planned up front and streamed
  one tensor at a time.
- :func:`write_hf_config` / :func:`copy_extra_files`: ``config.json`` and the tokenizer files.

Nothing here pickles: weights go to safetensors, configs to JSON.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import shutil
import struct
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open

from parallel_models.llama.checkpoint_utils.errors import CheckpointError

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
EXTRA_FILE_PATTERNS = ("generation_config.json", "tokenizer*", "special_tokens_map.json",
                       "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken",
                       "spiece.model", "chat_template*", "preprocessor_config.json")

SAFE_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
               torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
               torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
               torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def parse_size(size: int | str) -> int:
    """``5GB``, ``500MB``, ``2GiB``, or a number of bytes -> bytes."""
    if isinstance(size, int):
        return size
    text = str(size).strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    for unit, mult in units.items():
        if text.endswith(unit):
            try:
                return int(float(text[: -len(unit)]) * mult)
            except ValueError:
                break
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"cannot parse size {size!r}; use e.g. '5GB', '500MB' or bytes") from None


def resolve_model_path(path: str) -> str:
    """A local folder as is; otherwise an HF hub id fetched (config + safetensors + tokenizer)."""
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise CheckpointError(f"{path}: expected a model folder, got a file")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "tokenizer*",
                                                       "*.model", "*.txt"])
    except Exception as err:  # offline, unknown repo, ...
        raise CheckpointError(f"{path}: not a local folder and could not be fetched from the "
                              f"Hugging Face Hub ({type(err).__name__}: {err})") from err


class SafetensorsCheckpoint:
    """Lazy, slice-level access to the tensors of an HF safetensors folder."""

    def __init__(self, folder: str):
        self.folder = folder
        index_path = os.path.join(folder, SAFE_INDEX)
        single = os.path.join(folder, SAFE_SINGLE)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{index_path}: not a valid safetensors index ({err})") from err
            for fname in sorted(set(weight_map.values())):  # a shard outside the folder: never
                rel = os.path.normpath(str(fname))  # (symlinks inside it, as in the HF cache, ok)
                if os.path.isabs(rel) or rel == ".." or rel.startswith(".." + os.sep):
                    raise CheckpointError(f"{index_path}: shard path {fname!r} leaves the folder")
            self.files = {name: os.path.join(folder, fname) for name, fname in weight_map.items()}
            for fname in sorted(set(self.files.values())):
                if not os.path.isfile(fname):
                    raise CheckpointError(f"{fname}: shard named in {index_path} is missing")
        elif os.path.isfile(single):
            self.files = {name: single for name in self._open(single).keys()}
        else:
            found = sorted(os.listdir(folder))
            if any(f.endswith((".bin", ".pt", ".pth")) for f in found):
                raise CheckpointError(f"{folder}: only pickle weights (.bin/.pt) found; they are "
                                      "not loaded (unsafe). Convert them to safetensors.")
            raise CheckpointError(f"{folder}: no {SAFE_SINGLE} or {SAFE_INDEX}")
        self._handles: dict[str, object] = {}

    def _open(self, fname: str):
        handle = getattr(self, "_handles", {}).get(fname)
        if handle is None:
            try:
                handle = safe_open(fname, framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError) as err:
                raise CheckpointError(f"{fname}: cannot read safetensors file ({err})") from err
            if hasattr(self, "_handles"):
                self._handles[fname] = handle
        return handle

    def keys(self):
        return self.files.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _slice(self, name: str):
        if name not in self.files:
            raise CheckpointError(f"{self.folder}: tensor {name!r} not found in the checkpoint")
        fname = self.files[name]
        try:
            return self._open(fname).get_slice(name)
        except SafetensorError as err:
            raise CheckpointError(f"{fname}: cannot read tensor {name!r} ({err})") from err

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        from safetensors.torch import _getdtype  # maps "F32" -> torch.float32

        return _getdtype(self._slice(name).get_dtype())

    def __call__(self, name: str, dim: int | None, start: int | None, end: int | None):
        sl = self._slice(name)
        try:
            if dim is None:
                return sl[:]
            if dim == 0:
                return sl[start:end]
            if dim == 1:
                return sl[:, start:end]
        except SafetensorError as err:
            raise CheckpointError(f"{self.files[name]}: cannot read tensor {name!r} ({err})") from err
        raise ValueError(f"slicing along dim {dim} is not supported")


# ---- streaming safetensors shards ----------------------------------------------------------------------
def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * dtype.itemsize


class ShardedSafetensorsWriter:
    """Writes ``model-0000x-of-0000y.safetensors`` + ``model.safetensors.index.json`` one tensor
    at a time. The tensors (name, shape, dtype) are planned up front, so each file's header is
    written first and the data streamed after it: memory stays at about one tensor.

    ``write`` must be called in the planned order; ``close`` checks that all were written.
    """

    def __init__(self, folder: str, specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
                 max_shard_size: int | str = "5GB"):
        self.folder = folder
        self.specs = [(n, tuple(int(x) for x in s), d) for n, s, d in specs]
        names = [n for n, _, _ in self.specs]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names in the save plan")
        for n, _, d in self.specs:
            if d not in SAFE_DTYPES:
                raise CheckpointError(f"{n}: dtype {d} cannot be stored in safetensors")
        limit = parse_size(max_shard_size)
        shards: list[list[int]] = [[]]
        size = 0
        for i, (_, shape, dtype) in enumerate(self.specs):
            nb = _nbytes(shape, dtype)
            if shards[-1] and size + nb > limit:
                shards.append([])
                size = 0
            shards[-1].append(i)
            size += nb
        count = len(shards)
        self.files = [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
        self.shard_of = {}
        for k, idx in enumerate(shards):
            for i in idx:
                self.shard_of[i] = k
        self.shards = shards
        self.next = 0
        self.handle = None
        self.bytes_written = 0
        self.total_bytes = sum(_nbytes(s, d) for _, s, d in self.specs)

    def _open_shard(self, k: int) -> None:
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for i in self.shards[k]:
            name, shape, dtype = self.specs[i]
            nb = _nbytes(shape, dtype)
            header[name] = {"dtype": SAFE_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nb]}
            offset += nb
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self.handle = self._open_file(os.path.join(self.folder, self.files[k]))
        self.handle.write(struct.pack("<Q", len(raw)))
        self.handle.write(raw)

    def _open_file(self, path: str):
        """A writable handle for one shard file (subclasses stream it differently)."""
        return open(path, "wb")

    def _close_shard(self) -> None:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        self.handle = None

    @property
    def expected(self) -> str | None:
        return self.specs[self.next][0] if self.next < len(self.specs) else None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.next >= len(self.specs):
            raise CheckpointError(f"internal: tensor {name!r} written after the planned ones")
        want_name, shape, dtype = self.specs[self.next]
        if name != want_name:
            raise CheckpointError(f"internal: got tensor {name!r}, expected {want_name!r}")
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise CheckpointError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, planned "
                                  f"{shape} {dtype}")
        k = self.shard_of[self.next]
        if self.handle is None:
            self._open_shard(k)
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        if t.numel():
            self.handle.write(t.view(torch.uint8).numpy().data)
        self.bytes_written += t.numel() * t.element_size()
        self.next += 1
        if self.next == len(self.specs) or self.shard_of[self.next] != k:
            self._close_shard()

    def close(self) -> None:
        if self.next != len(self.specs):
            if self.handle is not None:
                self.handle.close()
            raise CheckpointError(f"internal: {len(self.specs) - self.next} planned tensors were "
                                  f"not written (next: {self.expected!r})")
        total_params = sum(_nbytes(s, d) // d.itemsize
                           for _, s, d in self.specs)
        index = {"metadata": {"total_size": self.total_bytes, "total_parameters": total_params},
                 "weight_map": {name: self.files[self.shard_of[i]]
                                for i, (name, _, _) in enumerate(self.specs)}}
        with open(os.path.join(self.folder, SAFE_INDEX), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")

    def abort(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


# ---- config.json and the files that travel with the weights -------------------------------------------
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def write_hf_config(folder: str, hf_config, *, architecture: str, head_kind: str,
                    dtype: torch.dtype | None) -> None:
    """``config.json`` for the saved weights: the source config with ``architectures`` set (value
    models as ``*ForSequenceClassification`` with ``num_labels=1``) and ``dtype`` set."""
    cfg = copy.deepcopy(hf_config)
    cfg.architectures = [architecture]
    if head_kind == "value":
        cfg.num_labels = 1
    if dtype is not None and dtype in DTYPE_NAMES:
        cfg.dtype = DTYPE_NAMES[dtype]
    cfg.to_json_file(os.path.join(folder, "config.json"), use_diff=True)


def copy_extra_files(src: str | None, dst: str) -> list[str]:
    """Copy tokenizer / generation-config files of ``src`` (when present) into ``dst``."""
    if not src or not os.path.isdir(src):
        return []
    copied = []
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if not os.path.isfile(path) or name == "config.json":
            continue
        if any(fnmatch.fnmatch(name, pat) for pat in EXTRA_FILE_PATTERNS):
            shutil.copyfile(path, os.path.join(dst, name))
            copied.append(name)
    return copied


# ---- reading safetensors without mmap -------------------------------------------------------------------
class SafetensorsFileReader:
    """Whole tensors of safetensors files read with ``readinto`` straight into their tensor (one
    copy, no memory map): a converter streaming a checkpoint keeps only the tensor at hand
    resident, where mapped pages would stay in its RSS until the file is closed."""

    _DTYPES = {v: k for k, v in SAFE_DTYPES.items()}

    def __init__(self):
        self._files: dict[str, tuple] = {}

    def _header(self, path: str):
        entry = self._files.get(path)
        if entry is None:
            f = open(path, "rb")
            try:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            except (struct.error, ValueError) as err:
                f.close()
                raise CheckpointError(f"{path}: cannot read safetensors header ({err})") from err
            header.pop("__metadata__", None)
            entry = (f, header, 8 + n, os.fstat(f.fileno()).st_size)
            self._files[path] = entry
        return entry

    def check(self, path: str) -> None:
        """Raise a CheckpointError if ``path`` is not a complete safetensors file."""
        _, header, base, size = self._header(path)
        end = max((info["data_offsets"][1] for info in header.values()), default=0)
        if base + end != size:
            raise CheckpointError(f"{path}: cannot read safetensors file: it is truncated or "
                                  f"padded ({size} bytes, its header describes {base + end})")

    def read(self, path: str, name: str) -> torch.Tensor:
        f, header, base, size = self._header(path)
        if name not in header:
            raise CheckpointError(f"{path}: tensor {name!r} not found")
        info = header[name]
        dtype = self._DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        out = torch.empty(info["shape"], dtype=dtype)
        nbytes = out.numel() * out.element_size()
        if end - start != nbytes or base + end > size:
            raise CheckpointError(f"{path}: {name} is truncated or its header is inconsistent")
        if nbytes:
            f.seek(base + start)
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            got = 0
            while got < nbytes:
                n = f.readinto(view[got:])
                if not n:
                    raise CheckpointError(f"{path}: file ends inside tensor {name!r}")
                got += n
        return out

    def close(self) -> None:
        for f, *_ in self._files.values():
            f.close()
        self._files.clear()
