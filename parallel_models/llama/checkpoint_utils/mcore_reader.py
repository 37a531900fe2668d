"""Reading a megatron-core ``GPTModel`` dist checkpoint (saved at any TP/PP, by megatron-core,
Megatron-LM, ``hf2mcore`` or ``save_mcore``) as if it were an HF checkpoint.

:class:`McoreCheckpoint` has the reader interface of ``hf_format.SafetensorsCheckpoint``
(``keys()``, ``in``, ``shape``, ``dtype`` and ``ckpt(hf_name, dim, start, end)``): rows/columns
of an HF tensor, read from only the chunks that hold them and turned into the HF layout by the
weight map's rules. The loader uses it to fill a model at any TP/PP (``from_pretrained`` on an
mcore folder) and ``mcore2hf`` to write HF files (``byte_ranges`` lets it copy contiguous rows
verbatim). Metadata is unpickled by an allow-list unpickler, chunks by torch's weights-only one.

Each tensor is looked up where megatron-core may have put it (:func:`mcore_candidates`): layers
stacked under one key with a leading layer axis (dense models; MoE models whose layers are all
MoE, saved with an integer ``moe_layer_freq`` by megatron-core, Megatron-LM or Megatron-Bridge:
routed experts then ``[layer, expert, ...]``) or one key per layer (``decoder.layers.{i}.``: our
MoE writes, a list ``moe_layer_freq``), under the norm names of any layer spec (``te``: an MoE
layer's ``pre_mlp_layernorm``; ``mcore-local``; ``local``). The chunks may split any axis (TP,
EP), so a checkpoint saved at one TP/EP reads at another.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from parallel_models.config import ModelConfig
from parallel_models.llama.checkpoint_utils.dcp import read_dcp_metadata
from parallel_models.llama.checkpoint_utils.direct_io import RangeReader
from parallel_models.llama.checkpoint_utils.errors import CheckpointError
from parallel_models.llama.checkpoint_utils.megatron_hf_config import hf_config_from_megatron
from parallel_models.llama.checkpoint_utils.megatron_format import (LOCAL_SPEC_NAMES,
                                                                   MCORE_LAYER_PREFIX,
                                                                   check_mcore_json,
                                                                   read_mcore_json,
                                                                   resolve_mcore_dir, side_file)
from parallel_models.llama.checkpoint_utils.torch_record import (decode_torch_record,
                                                                record_data_start)
from parallel_models.llama.checkpoint_utils.weight_map import WeightMap, WeightMapping


def config_of_mcore_dir(folder: str, metadata=None) -> ModelConfig:
    """The model config of the dist checkpoint in ``folder``: its ``config.json``, else the one
    Megatron-Bridge's ``run_config.yaml`` or the Megatron-LM args of its common state describe
    (the vocab: the embedding's stored rows)."""
    path = side_file(folder, "config.json")  # ours: here, or beside an iteration layout's tracker
    if path is not None:
        return ModelConfig.from_hf(os.path.dirname(path))
    if metadata is None:
        metadata = read_dcp_metadata(folder)
    emb = metadata.state_dict_metadata.get("embedding.word_embeddings.weight")
    rows = int(emb.size[0]) if emb is not None and hasattr(emb, "size") else None
    return ModelConfig.from_hf(hf_config_from_megatron(folder, rows))


@dataclasses.dataclass(frozen=True)
class _Source:
    mapping: WeightMapping
    key: str
    lead: tuple[int, ...]  # indices along the leading axes (layer and / or expert), outermost first
    component: int
    lead_sizes: tuple[int, ...] = ()  # the sizes of those axes


def _base_keys(mapping: WeightMapping) -> list[str]:
    """The names a mapping's tensor has under every layer spec (``LAYER_SPECS``), stacked form."""
    return list(dict.fromkeys([mapping.mcore, LOCAL_SPEC_NAMES.get(mapping.mcore, mapping.mcore)]))


def mcore_candidates(mapping: WeightMapping, config: ModelConfig, layer: int | None
                     ) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """Where a dist checkpoint may hold ``mapping``'s tensor of global layer ``layer``, as
    (key, leading indices, leading sizes), the layout we write first: megatron-core saves the
    layers either stacked under one key with a leading layer axis (homogeneous layers: a dense
    model, or every layer MoE with an integer ``moe_layer_freq``; Megatron-Bridge's MoE saves)
    or one key per layer (``decoder.layers.{i}.``: ``moe_layer_freq`` a list or an integer > 1);
    routed experts add an expert axis; each under the names of every layer spec."""
    if layer is None:
        return [(mapping.mcore, (), ())]
    experts = ((mapping.expert,), (config.num_experts,)) if mapping.expert is not None else ((), ())
    stacked = [(k, (layer, *experts[0]), (config.num_layers, *experts[1]))
               for k in _base_keys(mapping)]
    per_layer = [(k.replace(MCORE_LAYER_PREFIX, f"{MCORE_LAYER_PREFIX}{layer}.", 1), *experts)
                 for k in _base_keys(mapping)]
    return per_layer + stacked if config.is_moe else stacked + per_layer


class McoreCheckpoint:
    """An mcore dist checkpoint seen through HF names (the interface of ``SafetensorsCheckpoint``:
    ``keys()``, ``in``, ``shape``, ``dtype`` and ``ckpt(name, dim, start, end)``).

    ``config``: the model's config (default: ``config.json`` in the folder, as ``hf2mcore`` and
    ``save_mcore`` write it). ``head_kind``: "causal_lm" or "value" (default: from
    ``mcore_config.json``, else a one-row ``output_layer`` means a value head).
    """

    def __init__(self, folder: str, weight_map: WeightMap, config: ModelConfig | None = None,
                 head_kind: str | None = None):
        self.folder = resolve_mcore_dir(folder)
        self.metadata = read_dcp_metadata(self.folder)
        self.tensors = {k: v for k, v in self.metadata.state_dict_metadata.items()
                        if hasattr(v, "chunks")}
        self.info = read_mcore_json(self.folder) or {}
        if config is None:
            config = config_of_mcore_dir(self.folder, self.metadata)
        check_mcore_json(self.info, config, self.folder)
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
        local = LOCAL_SPEC_NAMES[te]

        def has(key):  # stacked, or per layer (then look at layer 0)
            return key in self.tensors or key.replace(
                MCORE_LAYER_PREFIX, f"{MCORE_LAYER_PREFIX}0.", 1) in self.tensors

        self.layer_spec = "local" if (not has(te) and has(local)) else "te"
        self.sources: dict[str, _Source] = {}
        self.weight_map = weight_map
        for mapping in weight_map.mappings(config, head_kind):
            for layer in (range(config.num_layers) if mapping.per_layer else [None]):
                if not mapping.applies_to(config, layer):
                    continue
                key, lead, sizes = self._locate(mapping, layer)
                for comp, hf in enumerate(mapping.hf_names(layer)):
                    self.sources[hf] = _Source(mapping, key, lead, comp, sizes)
        self._files: dict[str, Any] = {}
        self._cache: dict[tuple, torch.Tensor] = {}
        self._cache_scope: tuple | None = None
        self._starts: dict[tuple, tuple[str, int] | None] = {}
        self.bytes_read = 0

    def _locate(self, mapping: WeightMapping, layer: int | None):
        """The first of :func:`mcore_candidates` the checkpoint holds with those leading sizes
        (else the first one: ``validate`` names it as missing)."""
        options = mcore_candidates(mapping, self.config, layer)
        for key, lead, sizes in options:
            md = self.tensors.get(key)
            if md is not None and tuple(md.size)[:len(sizes)] == sizes:
                return key, lead, sizes
        return options[0]

    # -- interface of SafetensorsCheckpoint --
    def keys(self):
        return [n for n, s in self.sources.items() if s.key in self.tensors]

    def __contains__(self, name: str) -> bool:
        src = self.sources.get(name)
        return src is not None and src.key in self.tensors

    def shape(self, name: str) -> list[int]:
        src = self._source(name)
        return list(src.mapping.rule.hf_shapes(self.config)[src.component])

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[self._source(name).key].properties.dtype

    def __call__(self, name: str, dim: int | None, start: int | None, end: int | None):
        src = self._source(name)
        shape = self.shape(name)
        r0, r1 = (start, end) if dim == 0 else (0, shape[0])
        cols = (start, end) if dim == 1 else None
        if dim not in (None, 0, 1):
            raise ValueError(f"slicing along dim {dim} is not supported")
        parts = [self.read_region(src.key, src.lead, a, b, cols)
                 for a, b in src.mapping.rule.mcore_rows(src.component, r0, r1, self.config)]
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
            inner = src.mapping.rule.mcore_shape(self.config)
            want = (*src.lead_sizes, *inner)
            got = tuple(md.size)
            lead_ok = got[:len(src.lead_sizes)] == src.lead_sizes
            if not (lead_ok and src.mapping.rule.mcore_shape_ok(got[len(src.lead_sizes):],
                                                                 inner)):
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
    def read_region(self, key: str, lead: tuple[int, ...] | int | None, r0: int, r1: int,
                    cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows ``[r0, r1)`` (and columns ``cols``) of ``key`` at the leading indices ``lead``
        (a layer and / or an expert: a tuple, or one int; None or () for a tensor without
        leading axes), assembled from the chunks that overlap them."""
        md = self.tensors[key]
        size = tuple(md.size)
        lead = () if lead is None else (lead,) if isinstance(lead, int) else tuple(lead)
        nlead = len(lead)
        inner = size[nlead:]
        c0, c1 = cols if cols is not None else (0, inner[1] if len(inner) > 1 else None)
        lo = list(lead) + [r0] + ([c0] if len(inner) > 1 else [])
        hi = [i + 1 for i in lead] + [r1] + ([c1] if len(inner) > 1 else [])
        scope = (key, lead)
        if scope != self._cache_scope:
            self._cache.clear()
            self._cache_scope = scope
        for chunk in md.chunks:  # one chunk holds it all: a view, no copy
            off, sz = tuple(chunk.offsets), tuple(chunk.sizes)
            if all(o <= l and h <= o + s_ for l, h, o, s_ in zip(lo, hi, off, sz)):
                src = self._chunk(key, chunk)
                for d, (l, h) in enumerate(zip(lo, hi)):
                    src = src.narrow(d, l - off[d], h - l)
                return src.reshape(src.shape[nlead:])
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
                                  + (f" at leading index {lead}" if lead else "") + ")")
        return out.reshape(out.shape[nlead:])

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
    def byte_ranges(self, name: str, reader: RangeReader) -> list[tuple[str, int, int]] | None:
        """HF tensor ``name`` as ``(file, offset, length)`` byte ranges of the chunk files, in
        order, when each of its rows lies whole (every column) in a chunk whose record stores it
        contiguously (hf2mcore's output, megatron-core's at TP=1, column-parallel splits); else
        None (``self(name, ...)`` assembles it). Reads only the records' headers."""
        src = self._source(name)
        md = self.tensors[src.key]
        size = tuple(md.size)
        lead = len(src.lead)
        inner = size[lead:]
        row_bytes = int(torch.Size(inner[1:]).numel()) * torch.empty(
            (), dtype=md.properties.dtype).element_size()
        out: list[tuple[str, int, int]] = []
        for a, b in src.mapping.rule.mcore_rows(src.component, 0, self.shape(name)[0],
                                                self.config):
            r = a
            while r < b:
                for chunk in md.chunks:
                    off, sz = tuple(chunk.offsets), tuple(chunk.sizes)
                    if any(not o <= i < o + n for i, o, n in zip(src.lead, off, sz)) or \
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
                row = 0  # rows before ours in the chunk: its leading axes, row-major
                for i, o, n in zip(src.lead, off, sz):
                    row = row * n + (i - o)
                row = row * sz[lead] + r - off[lead]
                seg = (path, base + row * row_bytes, (stop - r) * row_bytes)
                if out and out[-1][0] == path and out[-1][1] + out[-1][2] == seg[1]:
                    seg = (path, out[-1][1], out[-1][2] + seg[2])
                    out.pop()
                out.append(seg)
                r = stop
        return out

    def _data_start(self, key: str, chunk, reader: RangeReader) -> tuple[str, int] | None:
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
