"""megatron-core ``GPTModel`` distributed checkpoints (``torch_dist`` format), read and written
through the one weight map.

The format, as megatron-core 0.16 writes it (``dist_checkpointing.save``):
- ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``), ``common.pt`` (the non-sharded
  part of the state dict; empty for a ``GPTModel``), ``.metadata`` (torch DCP's index: every key's
  global shape and dtype, its chunks, and where each chunk's bytes are) and ``__<rank>_<n>.distcp``
  files holding the chunks (each one a ``torch.save`` record).
- keys as ``GPTModel.sharded_state_dict()`` names them (see ``weight_map``); per-layer tensors
  stacked with a leading layer axis, one chunk per layer and TP shard; ``_extra_state`` objects
  as ``<key>/shard_<layer>_<num_layers>``.

What is here:
- :class:`McoreCheckpoint` reads such a checkpoint (saved at any TP/PP, by megatron-core or by us)
  as if it were an HF checkpoint: ``ckpt(hf_name, dim, start, end)`` returns rows/columns of an HF
  tensor, reading only the chunks that hold them. The loader uses it to fill a model at any TP/PP
  (``from_pretrained`` on an mcore folder) and ``mcore2hf`` to write HF files. Metadata is
  unpickled by an allow-list unpickler and chunks with ``torch.load(weights_only=True)``.
- :func:`write_dist_checkpoint` writes one from a plan of chunks whose data is produced on demand
  or copied verbatim from byte ranges of files (``hf2mcore``), with torch DCP's planner and
  metadata; the chunk files (``torch.save`` records, as DCP writes them) are streamed through
  :class:`WriteBehind` (reused buffers, O_DIRECT, write-behind fsync). :class:`RangeReader` reads
  byte ranges from the page cache or, when they are not there, with O_DIRECT.
- :func:`save_mcore` saves a TP/PP-sharded model of ours with megatron-core's
  ``dist_checkpointing.save``: every rank declares its shards as megatron ``ShardedTensor`` s
  (the same layout ``GPTModel`` declares), and megatron-core writes them in parallel.
- :func:`mcore_config_dict` / :func:`build_gpt_model`: the matching megatron-core
  ``TransformerConfig`` / ``GPTModel`` arguments, as JSON, and a builder from that JSON.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import errno
import fcntl
import io
import json
import mmap
import os
import pickle
import queue
import shutil
import threading
import time
import warnings
from typing import Any, Callable

import numpy
import torch

from parallel_models.config import ConfigError, ModelConfig
from parallel_models.llama.checkpoint_utils.loader import CheckpointError
from parallel_models.llama.checkpoint_utils.weight_map import (LOCAL_SPEC_NAMES,
                                                              MCORE_EXTRA_STATE_KEYS, WeightRule,
                                                              hf_shapes, mcore_key, mcore_pieces,
                                                              mcore_rows, weight_rules)

MCORE_CONFIG_FILE = "mcore_config.json"  # our JSON of TransformerConfig / GPTModel arguments
MEGATRON_METADATA = "metadata.json"      # megatron-core's: backend and version
DCP_METADATA = ".metadata"               # torch DCP's index
COMMON_FILE = "common.pt"
FORMAT = "parallel_models.mcore/1"


# ---- safe reading of DCP metadata ---------------------------------------------------------------------
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


# ---- locating a checkpoint ----------------------------------------------------------------------------
def is_mcore_checkpoint(path: str) -> bool:
    """A megatron-core dist checkpoint folder (or a Megatron-LM run folder pointing to one)."""
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, DCP_METADATA)):
        return True
    meta = os.path.join(path, MEGATRON_METADATA)
    if os.path.isfile(meta):
        try:
            with open(meta) as f:
                return "sharded_backend" in json.load(f)
        except (OSError, json.JSONDecodeError):
            return False
    return os.path.isfile(os.path.join(path, "latest_checkpointed_iteration.txt"))


def resolve_mcore_dir(path: str) -> str:
    """``path`` itself, or for a Megatron-LM run folder the iteration it names as latest."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such folder")
    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(os.path.join(path, MEGATRON_METADATA)) and os.path.isfile(tracker):
        with open(tracker) as f:
            it = f.read().strip()
        sub = os.path.join(path, "release" if it == "release" else f"iter_{int(it):07d}")
        if not os.path.isdir(sub):
            raise CheckpointError(f"{tracker} names iteration {it}, but {sub} is missing")
        return sub
    meta = os.path.join(path, MEGATRON_METADATA)
    if not os.path.isfile(meta):
        raise CheckpointError(f"{path}: no {MEGATRON_METADATA}; not a megatron-core dist checkpoint")
    try:
        with open(meta) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{meta}: not valid JSON ({err})") from err
    if backend != "torch_dist":
        raise CheckpointError(f"{path}: sharded_backend is {backend!r}; only 'torch_dist' "
                              "checkpoints are supported")
    return path


def read_mcore_json(folder: str) -> dict | None:
    path = os.path.join(folder, MCORE_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from err


# ---- reading -------------------------------------------------------------------------------------------
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
    import struct
    import sys
    import zipfile

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


@dataclasses.dataclass(frozen=True)
class _Source:
    rule: WeightRule
    key: str
    layer: int | None
    component: int


def expected_mcore_shape(rule: WeightRule, config: ModelConfig) -> tuple[int, ...]:
    shapes = hf_shapes(rule, config)
    if rule.rule in ("qkv", "gate_up"):
        return (sum(s[0] for s in shapes), *shapes[0][1:])
    return shapes[0]


class McoreCheckpoint:
    """An mcore dist checkpoint seen through HF names (the interface of ``SafetensorsCheckpoint``:
    ``keys()``, ``in``, ``shape``, ``dtype`` and ``ckpt(name, dim, start, end)``).

    ``config``: the model's config (default: ``config.json`` in the folder, as ``hf2mcore`` and
    ``save_mcore`` write it). ``head_kind``: "causal_lm" or "value" (default: from
    ``mcore_config.json``, else a one-row ``output_layer`` means a value head).
    """

    def __init__(self, folder: str, config: ModelConfig | None = None,
                 head_kind: str | None = None):
        self.folder = resolve_mcore_dir(folder)
        self.metadata = read_dcp_metadata(self.folder)
        self.tensors = {k: v for k, v in self.metadata.state_dict_metadata.items()
                        if hasattr(v, "chunks")}
        self.info = read_mcore_json(self.folder) or {}
        if config is None:
            if not os.path.isfile(os.path.join(self.folder, "config.json")):
                raise CheckpointError(
                    f"{self.folder}: no config.json next to the dist checkpoint; pass the HF "
                    "config of the model (mcore2hf --hf-config DIR)")
            config = ModelConfig.from_hf(self.folder)
        self.config = config
        if head_kind is None:
            if "value_head" in self.info:
                head_kind = "value" if self.info["value_head"] else "causal_lm"
            else:
                out = self.tensors.get("output_layer.weight")
                head_kind = ("value" if out is not None and out.size[0] == 1
                             and config.vocab_size != 1 else "causal_lm")
        self.head_kind = head_kind
        te = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
        self.layer_spec = "local" if (te not in self.tensors
                                      and LOCAL_SPEC_NAMES[te] in self.tensors) else "te"
        self.sources: dict[str, _Source] = {}
        self.rules = weight_rules(config, head_kind)
        for rule in self.rules:
            key = mcore_key(rule, self.layer_spec)
            layers = range(config.num_layers) if rule.per_layer else [None]
            for layer in layers:
                for comp, name in enumerate(rule.hf):
                    hf = name.format(i=layer) if layer is not None else name
                    self.sources[hf] = _Source(rule, key, layer, comp)
        self._files: dict[str, Any] = {}
        self._cache: dict[tuple, torch.Tensor] = {}
        self._cache_scope: tuple | None = None
        self._starts: dict[tuple, tuple[str, int] | None] = {}
        self.bytes_read = 0

    # -- interface of SafetensorsCheckpoint --
    def keys(self):
        return [n for n, s in self.sources.items() if s.key in self.tensors]

    def __contains__(self, name: str) -> bool:
        src = self.sources.get(name)
        return src is not None and src.key in self.tensors

    def shape(self, name: str) -> list[int]:
        src = self._source(name)
        return list(hf_shapes(src.rule, self.config)[src.component])

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[self._source(name).key].properties.dtype

    def __call__(self, name: str, dim: int | None, start: int | None, end: int | None):
        src = self._source(name)
        shape = self.shape(name)
        r0, r1 = (start, end) if dim == 0 else (0, shape[0])
        cols = (start, end) if dim == 1 else None
        if dim not in (None, 0, 1):
            raise ValueError(f"slicing along dim {dim} is not supported")
        parts = [self.read_region(src.key, src.layer, a, b, cols)
                 for a, b in mcore_rows(src.rule, src.component, r0, r1, self.config)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def _source(self, name: str) -> _Source:
        src = self.sources.get(name)
        if src is None or src.key not in self.tensors:
            raise CheckpointError(f"{self.folder}: tensor {name!r} not found in the checkpoint"
                                  + (f" (megatron key {src.key!r})" if src else ""))
        return src

    # -- checks --
    def validate(self, names=None) -> None:
        """Raise a CheckpointError naming what is missing or inconsistent, before any reading:
        keys, global shapes against the config, the chunk files and their sizes."""
        names = list(self.sources) if names is None else list(names)
        L = self.config.num_layers
        missing, bad = [], []
        keys: dict[str, _Source] = {}
        for name in names:
            src = self.sources[name]
            if src.key not in self.tensors:
                missing.append(f"{src.key} (for {name})")
            else:
                keys.setdefault(src.key, src)
        if missing:
            raise CheckpointError(f"{self.folder}: the dist checkpoint lacks "
                                  f"{len(missing)} tensor(s): {', '.join(sorted(set(missing))[:8])}"
                                  + (" ..." if len(set(missing)) > 8 else ""))
        for key, src in keys.items():
            md = self.tensors[key]
            want = expected_mcore_shape(src.rule, self.config)
            if src.layer is not None:
                want = (L, *want)
            got = tuple(md.size)
            vocab_ok = (src.rule.rule == "vocab" and len(got) == 2 and got[0] >= want[0]
                        and got[1] == want[1])
            if got != want and not vocab_ok:
                bad.append(f"{key}: shape {got}, the config gives {want}")
            volume = sum(int(torch.Size(c.sizes).numel()) for c in md.chunks)
            if volume < int(torch.Size(got).numel()):
                bad.append(f"{key}: its chunks cover {volume} of {int(torch.Size(got).numel())} "
                           "elements (chunks missing)")
        if bad:
            raise CheckpointError(f"{self.folder}: checkpoint does not match the config: "
                                  + "; ".join(bad[:8]))
        sizes: dict[str, int] = {}
        for index, info in self.metadata.storage_data.items():
            if index.fqn.split("/")[0] not in keys:
                continue
            if info.transform_descriptors:
                raise CheckpointError(f"{self.folder}: {index.fqn} is stored with transforms "
                                      f"{info.transform_descriptors}; not supported")
            path = os.path.join(self.folder, info.relative_path)
            if info.relative_path not in sizes:
                if not os.path.isfile(path):
                    raise CheckpointError(f"{path}: checkpoint file is missing (it holds "
                                          f"{index.fqn})")
                sizes[info.relative_path] = os.path.getsize(path)
            if info.offset + info.length > sizes[info.relative_path]:
                raise CheckpointError(f"{path}: file is truncated ({sizes[info.relative_path]} "
                                      f"bytes; {index.fqn} ends at {info.offset + info.length})")

    # -- chunk reading --
    def read_region(self, key: str, layer: int | None, r0: int, r1: int,
                    cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows ``[r0, r1)`` (and columns ``cols``) of one layer of ``key`` (or of the whole
        tensor when ``layer`` is None), assembled from the chunks that overlap them."""
        md = self.tensors[key]
        size = tuple(md.size)
        lead = 1 if layer is not None else 0
        inner = size[lead:]
        c0, c1 = cols if cols is not None else (0, inner[1] if len(inner) > 1 else None)
        lo = ([layer] if lead else []) + [r0] + ([c0] if len(inner) > 1 else [])
        hi = ([layer + 1] if lead else []) + [r1] + ([c1] if len(inner) > 1 else [])
        scope = (key, layer)
        if scope != self._cache_scope:
            self._cache.clear()
            self._cache_scope = scope
        for chunk in md.chunks:  # one chunk holds it all: a view, no copy
            off, sz = tuple(chunk.offsets), tuple(chunk.sizes)
            if all(o <= l and h <= o + s_ for l, h, o, s_ in zip(lo, hi, off, sz)):
                src = self._chunk(key, chunk)
                for d, (l, h) in enumerate(zip(lo, hi)):
                    src = src.narrow(d, l - off[d], h - l)
                return src[0] if lead else src
        out = torch.empty([h - l for l, h in zip(lo, hi)], dtype=md.properties.dtype)
        covered = 0
        for chunk in md.chunks:
            off, sz = tuple(chunk.offsets), tuple(chunk.sizes)
            a = [max(l, o) for l, o in zip(lo, off)]
            b = [min(h, o + s) for h, o, s in zip(hi, off, sz)]
            if any(x >= y for x, y in zip(a, b)):
                continue
            data = self._chunk(key, chunk)
            src = data
            dst = out
            for d, (x, y) in enumerate(zip(a, b)):
                src = src.narrow(d, x - off[d], y - x)
                dst = dst.narrow(d, x - lo[d], y - x)
            dst.copy_(src)
            covered += src.numel()
        if covered != out.numel():
            raise CheckpointError(f"{self.folder}: chunks of {key} cover {covered} of the "
                                  f"{out.numel()} elements asked for (rows {r0}:{r1}"
                                  + (f" of layer {layer}" if layer is not None else "") + ")")
        return out[0] if lead else out

    def _chunk(self, key: str, chunk) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        ck = (key, tuple(chunk.offsets))
        if ck in self._cache:
            return self._cache[ck]
        index = MetadataIndex(key, chunk.offsets)
        info = self.metadata.storage_data.get(index)
        if info is None:
            raise CheckpointError(f"{self.folder}: no storage entry for {key} at "
                                  f"{tuple(chunk.offsets)}")
        if info.transform_descriptors:
            raise CheckpointError(f"{self.folder}: {key} is stored with transforms "
                                  f"{info.transform_descriptors}; not supported")
        path = os.path.join(self.folder, info.relative_path)
        f = self._files.get(path)
        if f is None:
            try:
                f = open(path, "rb")
            except OSError as err:
                raise CheckpointError(f"{path}: cannot open checkpoint file ({err})") from err
            self._files[path] = f
        f.seek(info.offset)
        raw = torch.empty(info.length, dtype=torch.uint8)  # not zero-filled
        view, got = memoryview(raw.numpy()), 0
        while got < info.length:
            n = f.readinto(view[got:])
            if not n:
                raise CheckpointError(f"{path}: file is truncated (reading {key})")
            got += n
        del view
        try:
            data = decode_torch_record(raw)
        except Exception as err:  # corrupt record
            raise CheckpointError(f"{path}: cannot read {key} at {tuple(chunk.offsets)} "
                                  f"({type(err).__name__}: {err})") from err
        del raw
        if not isinstance(data, torch.Tensor) or tuple(data.shape) != tuple(chunk.sizes):
            raise CheckpointError(f"{path}: {key} at {tuple(chunk.offsets)} holds "
                                  f"{getattr(data, 'shape', type(data))}, expected "
                                  f"{tuple(chunk.sizes)}")
        self.bytes_read += data.numel() * data.element_size()
        self._cache[ck] = data
        return data

    # -- byte ranges, for copying tensors verbatim --
    def byte_ranges(self, name: str, reader: "RangeReader") -> list[tuple[str, int, int]] | None:
        """HF tensor ``name`` as ``(file, offset, length)`` byte ranges of the chunk files, in
        order, when each of its rows lies whole (every column) in a chunk whose record stores it
        contiguously (hf2mcore's output, megatron-core's at TP=1, column-parallel splits); else
        None (``self(name, ...)`` assembles it). Reads only the records' headers."""
        src = self._source(name)
        md = self.tensors[src.key]
        size = tuple(md.size)
        lead = 1 if src.layer is not None else 0
        inner = size[lead:]
        row_bytes = int(torch.Size(inner[1:]).numel()) * torch.empty(
            (), dtype=md.properties.dtype).element_size()
        out: list[tuple[str, int, int]] = []
        for a, b in mcore_rows(src.rule, src.component, 0, self.shape(name)[0], self.config):
            r = a
            while r < b:
                for chunk in md.chunks:
                    off, sz = tuple(chunk.offsets), tuple(chunk.sizes)
                    if (lead and not off[0] <= src.layer < off[0] + sz[0]) or \
                            not off[lead] <= r < off[lead] + sz[lead]:
                        continue
                    if any(off[lead + 1:]) or sz[lead + 1:] != inner[1:]:
                        return None  # split by columns: rows are not contiguous
                    break
                else:
                    return None
                start = self._data_start(src.key, chunk, reader)
                if start is None:
                    return None
                path, base = start
                stop = min(b, off[lead] + sz[lead])
                row = ((src.layer - off[0]) * sz[lead] if lead else 0) + r - off[lead]
                seg = (path, base + row * row_bytes, (stop - r) * row_bytes)
                if out and out[-1][0] == path and out[-1][1] + out[-1][2] == seg[1]:
                    seg = (path, out[-1][1], out[-1][2] + seg[2])
                    out.pop()
                out.append(seg)
                r = stop
        return out

    def _data_start(self, key: str, chunk, reader: "RangeReader") -> tuple[str, int] | None:
        """(file, offset) of a chunk's first element, from its record's head and tail only."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        ck = (key, tuple(chunk.offsets))
        if ck not in self._starts:
            info = self.metadata.storage_data.get(MetadataIndex(key, chunk.offsets))
            if info is None or info.transform_descriptors:
                return None  # the general path raises the clear error
            path = os.path.join(self.folder, info.relative_path)
            n = info.length
            head = bytearray(min(n, 1 << 16))
            tail = bytearray(min(n - len(head), 1 << 16))
            reader.read_into(path, info.offset, head)
            reader.read_into(path, info.offset + n - len(tail), tail)
            start = record_data_start(head, tail, n, self.tensors[key].properties.dtype,
                                      chunk.sizes)
            self._starts[ck] = None if start is None else (path, info.offset + start)
        return self._starts[ck]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._cache.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---- streaming file I/O: reused aligned buffers, O_DIRECT, write-behind --------------------------
# Why: converting a checkpoint copies bytes, and copying within memory that is already mapped is
# cheap (> 10 GB/s); what costs is fresh memory: every page-cache page a buffered write or read
# creates, and every newly allocated tensor, is a page fault / page allocation (about 1 GB/s on
# a VM, where page faults are expensive). So the converters stream through a few buffers faulted
# in once and reused; they write them with O_DIRECT (from our buffer to the device, no page cache)
# on a background thread while the next buffer is filled, and read with O_DIRECT what is not in
# the page cache already.
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
            sf, buf, offset, n, last = job
            try:
                if not self._cancel and self._error is None:
                    sf._write(buf[:n], offset, last)
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

    def tell(self) -> int:
        return self.pos

    def write(self, data) -> int:
        """Copy ``data`` (bytes-like) into the file."""
        mv = memoryview(data).cast("B")

        def copy(dst: memoryview, done: int) -> None:
            dst[:] = mv[done:done + len(dst)]

        return self.fill(len(mv), copy)

    def fill(self, n: int, produce: Callable[[memoryview, int], Any]) -> int:
        """Append ``n`` bytes that ``produce(dst, done)`` writes into ``dst`` (a piece of the
        buffer; ``done`` = bytes of the ``n`` produced before): e.g. read from a source file
        straight into the buffer."""
        done = 0
        while done < n:
            k = min(n - done, self.wb.size - self._fill)
            produce(self._buf[self._fill:self._fill + k], done)
            done += k
            self._fill += k
            self.pos += k
            if self._fill == self.wb.size:
                self.wb._submit((self, self._buf, self._base, self._fill, False))
                self._base += self._fill
                self._fill = 0
                self._buf = self.wb._take()
        return n

    def close(self) -> None:
        """Queue the tail, fsync and close (done on the background thread)."""
        buf, self._buf = self._buf, None
        self.wb._submit((self, buf, self._base, self._fill, True))

    def abort(self) -> None:
        if self._buf is not None:
            buf, self._buf = self._buf, None
            self.wb._cancel = True
            self.wb._jobs.put((self, buf, self._base, 0, True))

    def _write(self, mv: memoryview, offset: int, last: bool) -> None:  # background thread
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


@contextlib.contextmanager
def _no_crc32():
    """torch.save without its CRC32 of every record (a full extra pass over the data; torch.load
    and megatron-core do not check it): scoped, the previous setting is restored."""
    prev = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(prev)


class _RecordSink:
    """What ``torch.save`` writes to: its bytes go into a :class:`StreamFile`, except the data of
    a placeholder tensor (memory never touched), which ``fill`` produces in their place, e.g.
    straight from the source files. The record is byte for byte the one torch.save writes."""

    def __init__(self, out: StreamFile, placeholder: torch.Tensor | None = None,
                 fill: Callable | None = None):
        self.out = out
        self.ptr = placeholder.data_ptr() if placeholder is not None else None
        self.nbytes = placeholder.nbytes if placeholder is not None else 0
        self.fill = fill
        self.filled = False
        self.error: BaseException | None = None

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        if self.error is not None:  # torch.save still ends the record after a failed write
            return len(mv)
        try:
            if (self.ptr is not None and len(mv) == self.nbytes and not self.filled
                    and numpy.frombuffer(mv, dtype=numpy.uint8).ctypes.data == self.ptr):
                self.out.fill(self.nbytes, self.fill)
                self.filled = True
            else:
                self.out.write(mv)
        except BaseException as err:
            self.error = err
            raise
        return len(mv)

    def flush(self) -> None:
        pass

    def save(self, tensor: torch.Tensor) -> None:
        """torch.save ``tensor`` here; a write's error (a read error, Ctrl-C) is raised as it
        is, not as the error torch.save's cleanup raises after it."""
        try:
            torch.save(tensor, self)
        except BaseException:
            if self.error is not None:
                raise self.error from None
            raise


class _Placeholder:
    """Tensors of any shape / dtype over reserved but never touched memory (no RSS): what
    torch.save is given when the data itself is copied from the source files."""

    def __init__(self):
        self._mem = None

    def tensor(self, sizes, dtype: torch.dtype) -> torch.Tensor:
        numel = int(torch.Size(sizes).numel())
        nbytes = numel * dtype.itemsize
        if self._mem is None or len(self._mem) < nbytes:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
            self._mem = mmap.mmap(-1, max(nbytes, _ALIGN), flags=flags)
        # storage of exactly the tensor's size, offset 0: as DCP hands tensors to torch.save
        return torch.frombuffer(self._mem, dtype=dtype, count=numel).view(sizes)


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


# ---- writing (one process, chunks produced on demand) --------------------------------------------------
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


def extra_state_items(num_layers: int) -> list[tuple[str, bytes]]:
    """The ``_extra_state`` objects megatron-core saves for each linear of each layer. Local-spec
    linears have none (``None``); transformer-engine's accept ``None`` (no FP8 state) on load."""
    buf = io.BytesIO()
    torch.save([None], buf)  # what megatron-core writes for a ShardedObject holding None
    raw = buf.getvalue()
    return [(f"{key}/shard_{i}_{num_layers}", raw) for key in MCORE_EXTRA_STATE_KEYS
            for i in range(num_layers)]


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


def _direct_writer(folder: str, bucket_bytes: int, threads: int, on_item=None,
                   stats: dict | None = None):
    """torch DCP's FileSystemWriter (its plan, ``.metadata`` and file names), writing the
    ``.distcp`` files itself: each chunk is the ``torch.save`` record DCP writes (saved without
    CRC32), streamed through a :class:`WriteBehind`, the data of chunks with ``segments`` read
    straight from their files into its buffers. Chunks go in plan order into files of about
    ``bucket_bytes``; ``threads`` files are written at a time (each thread with its buffers)."""
    import concurrent.futures

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    resolve_lock = threading.Lock()  # resolve() reads through shared file handles
    stats = {"direct_read_bytes": 0} if stats is None else stats

    def write_file(planner, out: StreamFile, name: str, bucket, reader: RangeReader,
                   placeholder: _Placeholder) -> list:
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
                    ph = placeholder.tensor(it.sizes, it.dtype)
                    sink = _RecordSink(out, ph, segment_filler(reader, it.segments))
                    sink.save(ph)
                    if not sink.filled:
                        raise CheckpointError("internal: torch.save did not write the tensor "
                                              "data in one piece")
                else:
                    with resolve_lock:
                        data = planner.resolve_data(item)
                    _RecordSink(out).save(data)
                if on_item is not None:
                    on_item(it, it.nbytes)
            length = out.tell() - offset
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(name, offset, length)))
        return results

    def write_files(planner, jobs) -> list:
        wb, reader, placeholder = WriteBehind(), RangeReader(), _Placeholder()
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
            with _no_crc32():
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
    stream buffers per writer thread. ``on_item(item, nbytes)`` after each chunk. Also writes
    ``common.pt`` (empty) and megatron's ``metadata.json``. Every file is fsynced. Returns
    ``{"direct_read_bytes"}``: segment bytes that were not in the page cache."""
    import torch.distributed.checkpoint as dcp

    planner = _save_planner(items, objects)
    largest = max((it.nbytes for it in items), default=0)
    stats = {"direct_read_bytes": 0}
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
    _write_megatron_files(folder)
    return stats


def _write_megatron_files(folder: str) -> None:
    # exactly what megatron-core's dist_checkpointing.save adds (the common state of a GPTModel
    # is an empty dict; torch.save is the format megatron-core reads it with)
    with open(os.path.join(folder, COMMON_FILE), "wb") as f:
        torch.save({}, f)
        f.flush()
        os.fsync(f.fileno())
    with open(os.path.join(folder, MEGATRON_METADATA), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)
        f.flush()
        os.fsync(f.fileno())


# ---- megatron-core model arguments ----------------------------------------------------------------------
def check_megatron_compatible(config: ModelConfig) -> None:
    """Raise a ConfigError for models megatron-core's GPTModel cannot express."""
    if config.o_bias != config.mlp_bias or (config.o_bias and not config.qkv_bias):
        raise ConfigError(
            f"attention_bias={config.o_bias}, mlp_bias={config.mlp_bias}: megatron-core's "
            "add_bias_linear puts a bias on every linear (qkv, proj, fc1, fc2) and add_qkv_bias on "
            "qkv only; this combination has no GPTModel equivalent")


def _rope_args(config: ModelConfig) -> tuple[dict, list[str]]:
    notes = []
    args = {"rotary_base": config.rope_theta, "rotary_percent": 1.0, "rope_scaling": False,
            "rope_scaling_factor": 8.0, "seq_len_interpolation_factor": None}
    rs = config.rope_scaling or {}
    kind = config.rope_type
    if kind == "llama3":
        args["rope_scaling"] = True
        args["rope_scaling_factor"] = float(rs.get("factor", 8.0))
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
        diff = {k: rs.get(k) for k, v in fixed.items() if float(rs.get(k, v)) != v}
        if diff:
            notes.append(f"rope llama3 with {diff}: megatron-core 0.16 fixes low_freq_factor=1, "
                         "high_freq_factor=4, original_max_position_embeddings=8192; its rotary "
                         "embedding will differ from the HF model's")
    elif kind == "linear":
        args["seq_len_interpolation_factor"] = float(rs["factor"])
    elif kind != "default":
        notes.append(f"rope scaling {kind!r} has no megatron-core GPTModel equivalent; plain RoPE "
                     "is configured")
    return args, notes


def mcore_config_dict(config: ModelConfig, *, head_kind: str, dtype: torch.dtype,
                      layer_spec: str) -> dict:
    """The JSON written next to a dist checkpoint: megatron-core ``TransformerConfig`` and
    ``GPTModel`` arguments that reproduce the model (plus what is not expressible, in notes)."""
    check_megatron_compatible(config)
    rope, notes = _rope_args(config)
    dname = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    tc = {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "ffn_hidden_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_query_groups": config.num_key_value_heads,
        "kv_channels": config.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": config.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": "silu",
        "add_bias_linear": bool(config.o_bias),
        "add_qkv_bias": bool(config.qkv_bias),
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "init_method_std": config.initializer_range,
        "params_dtype": dname,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
    }
    gpt = {
        "vocab_size": config.vocab_size,
        "max_sequence_length": config.max_position_embeddings,
        "position_embedding_type": "rope",
        "share_embeddings_and_output_weights": bool(config.tie_word_embeddings
                                                    and head_kind == "causal_lm"),
        **rope,
    }
    if head_kind == "value":
        notes.append("value model: output_layer.weight is [1, hidden] (the value head, as verl's "
                     "critic); build GPTModel with an output layer of size 1")
    return {
        "format": FORMAT,
        "layer_spec": layer_spec,
        "value_head": head_kind == "value",
        "dtype": dname,
        "hf_architecture": config.architecture,
        "transformer_config": tc,
        "gpt_model": gpt,
        "vocab_note": "the checkpoint holds the true vocab rows; megatron-core pads the vocab "
                      "(e.g. to a multiple of 128 x TP) and loads the stored rows into it",
        "notes": notes,
    }


def build_gpt_model(mcore_json: dict | str, *, layer_spec="local",
                    vocab_multiple: int = 128, pre_process: bool = True,
                    post_process: bool = True, **overrides):
    """A megatron-core ``GPTModel`` for this rank from the JSON :func:`mcore_config_dict` writes
    (a dict, or a checkpoint folder / JSON path). The vocab is padded to a multiple of
    ``vocab_multiple`` x TP like Megatron-LM does. Call after ``init_parallel``; on the CPU wrap
    it in ``cpu_shim.cuda_to_cpu()``."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    if isinstance(mcore_json, str):
        path = os.path.join(mcore_json, MCORE_CONFIG_FILE) if os.path.isdir(mcore_json) else mcore_json
        with open(path) as f:
            mcore_json = json.load(f)
    tc = dict(mcore_json["transformer_config"])
    act = tc.pop("activation_func")
    if act != "silu":
        raise ConfigError(f"activation {act!r} is not supported")
    tc["activation_func"] = torch.nn.functional.silu
    tc["params_dtype"] = getattr(torch, tc["params_dtype"])
    tp = mpu.get_tensor_model_parallel_world_size()
    tc.update(tensor_model_parallel_size=tp,
              pipeline_model_parallel_size=mpu.get_pipeline_model_parallel_world_size(),
              use_cpu_initialization=not torch.cuda.is_available(),
              bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
              apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)
    tc.update(overrides.pop("transformer_config", {}))
    config = TransformerConfig(**tc)
    if layer_spec == "local":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    elif layer_spec == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec()
    elif isinstance(layer_spec, str):
        raise ValueError(f"layer_spec must be 'local', 'te' or a ModuleSpec, got {layer_spec!r}")
    else:
        spec = layer_spec
    g = dict(mcore_json["gpt_model"])
    multiple = vocab_multiple * tp
    g["vocab_size"] = -(-g["vocab_size"] // multiple) * multiple
    g.update(overrides)
    return GPTModel(config=config, transformer_layer_spec=spec, pre_process=pre_process,
                    post_process=post_process, **g)


# ---- save_mcore: a model of ours -> dist checkpoint, every rank writing its shards ----------------------
def _sync_save_strategy():
    """megatron-core's torch_dist save, written synchronously by torch DCP's plain writer.

    megatron-core's default strategy forks writer processes (not allowed in daemon processes,
    e.g. multiprocessing workers); this one differs only in who writes the files: the state dict
    translation, the planner and hence the format are megatron-core's own."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, TorchDistSaveShardedStrategy, _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint import FileSystemWriter

    class SyncTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            sd, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica)
            pyt_state_dict = mcore_to_pyt_state_dict(sd, False)
            dcp.save(pyt_state_dict,
                     storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=1,
                                                     overwrite=True),
                     planner=MCoreSavePlanner(dedup_replicated_tensors=False,
                                              flatten_state_dict=False))

    return SyncTorchDistSave("torch_dist", 1)


def model_sharded_state_dict(model, layer_spec: str = "te") -> dict:
    """This rank's weights as megatron-core ``ShardedTensor`` s / ``ShardedObject`` s under the keys
    and layout ``GPTModel.sharded_state_dict()`` uses (``model``: a model or its VPP chunks)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    config = chunks[0].config
    head_kind = chunks[0].head_kind
    L = config.num_layers
    tp = mpu.get_tensor_model_parallel_world_size()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
    out: dict = {}

    def add(rule, tensor, layer):
        key = mcore_key(rule, layer_spec)
        for k, piece in enumerate(mcore_pieces(rule, tensor, config, tp, tp_rank)):
            offsets = []
            if layer is not None:
                offsets.append((0, layer, L))
            if piece.axis is not None:
                offsets.append((piece.axis + (1 if layer is not None else 0), piece.index,
                                piece.count))
            # dict keys must be unique on this rank: VPP chunks reuse local layer names
            out[f"{key}#{layer}#{k}"] = ShardedTensor.from_rank_offsets(
                key, piece.tensor, *offsets, replica_id=(0, piece.replica, dp_rank),
                prepend_axis_num=1 if layer is not None else 0)

    for chunk in chunks:
        params = dict(chunk.named_parameters())
        rules = weight_rules(config, head_kind, pre_process=chunk.pre_process,
                             post_process=chunk.post_process)
        for rule in rules:
            if rule.per_layer:
                for li, layer in enumerate(chunk.model.layers):
                    name = rule.ours.format(i=li)
                    add(rule, params[name].detach(), layer.layer_id)
            elif rule.ours == "lm_head.proj.weight" and rule.mcore.startswith("embedding."):
                continue  # a tied last stage's copy of the embedding: saved by the first stage
            else:
                add(rule, params[rule.ours].detach(), None)
        for li, layer in enumerate(chunk.model.layers):
            for key in MCORE_EXTRA_STATE_KEYS:
                out[f"{key}#{layer.layer_id}"] = ShardedObject(
                    key, None, (L,), (layer.layer_id,), replica_id=(0, tp_rank, dp_rank))
    return out


def save_mcore(model, out_dir: str, *, layer_spec: str = "te", overwrite: bool = False,
               source_dir: str | None = None) -> dict:
    """Save a TP/PP-sharded model of ours as a megatron-core ``GPTModel`` dist checkpoint that
    megatron-core (and ``from_pretrained``) loads at any TP/PP, plus ``config.json``,
    ``mcore_config.json`` and the tokenizer files. Call on every rank; written into a temporary
    folder and renamed at the end (all or nothing)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from parallel_models import cpu_shim
    from parallel_models.llama.checkpoint_utils.files import (check_output_dir, copy_extra_files,
                                                             hf_architecture, temp_dir_for,
                                                             write_hf_config)
    from parallel_models.llama.checkpoint_utils.saver import (_all_ok, _device_of, _family,
                                                              publish_or_raise)

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    first = chunks[0]
    config = first.config
    device = _device_of(chunks)
    rank = dist.get_rank()
    start = time.perf_counter()
    error = None
    info = None
    if rank == 0:
        try:
            check_output_dir(out_dir, overwrite)
            info = mcore_config_dict(config, head_kind=first.head_kind, dtype=first.dtype,
                                     layer_spec=layer_spec)
        except (CheckpointError, ConfigError) as err:
            error = err
    if not _all_ok(error is None, device):
        raise error if error is not None else CheckpointError(
            f"save_mcore: rank 0 cannot write {out_dir} (see rank 0's error)")
    # one temporary folder name for all ranks
    tag = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)
    dist.broadcast(tag, src=0)
    tmp = temp_dir_for(out_dir, f"{int(tag.item()):x}")
    if rank == 0:
        os.makedirs(tmp)
    dist.barrier()
    failure = None
    try:
        sharded = model_sharded_state_dict(chunks, layer_spec)
        # megatron-core checks the sharding on rank 0 only and raises there, which would leave
        # the other ranks waiting in the save: check first and let every rank know
        from megatron.core.dist_checkpointing.validation import (determine_global_metadata,
                                                                 validate_sharding_integrity)

        validate_sharding_integrity(determine_global_metadata(sharded)[1])
    except BaseException as err:  # noqa: BLE001
        failure = err
    if not _all_ok(failure is None, device):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise failure or CheckpointError("save_mcore: invalid sharding (see rank 0's error)")
    try:
        with cpu_shim.cuda_to_cpu():
            dist_checkpointing.save(sharded, tmp, sharded_strategy=_sync_save_strategy(),
                                    validate_access_integrity=False)
    except BaseException as err:  # noqa: BLE001
        failure = err
    if rank == 0 and failure is None:
        try:
            write_hf_config(tmp, config.hf_config,
                            architecture=hf_architecture(_family(config.architecture),
                                                         first.head_kind),
                            head_kind=first.head_kind, dtype=first.dtype)
            with open(os.path.join(tmp, MCORE_CONFIG_FILE), "w") as f:
                json.dump(info, f, indent=2)
            copy_extra_files(source_dir if source_dir is not None
                             else getattr(first, "name_or_path", None), tmp)
        except BaseException as err:  # noqa: BLE001
            failure = err
    publish_or_raise(tmp, out_dir, overwrite, failure, device, rank, "save_mcore")
    return {"path": out_dir, "seconds": time.perf_counter() - start}
