"""hf2mcore: an HF folder (or hub id) of a supported family -> a megatron-core ``GPTModel`` dist
checkpoint. The families (from ``parallel_models.llama.families``, the registry) are listed at the
end of this docstring and in ``--help``.

    hf2mcore --hf-path DIR_OR_HUB_ID --output DIR [--overwrite] [--dtype bfloat16|float16|float32]
             [--layer-spec te|mcore-local|local] [--value] [--format bridge|megatron-lm|flat]

``--format`` (``checkpoint_utils.megatron_layout``): ``bridge`` (default) writes Megatron-LM's
iteration layout (``latest_checkpointed_iteration.txt``, ``iter_0000000/`` with Megatron-LM's args,
``checkpoint_version`` and ``iteration`` in the common state) plus Megatron-Bridge's
``run_config.yaml``, so both open it as it is; ``megatron-lm`` the same without the YAML; ``flat``
the dist checkpoint in the folder itself. The dist checkpoint is a ``torch_dist`` checkpoint that ``megatron.core.dist_checkpointing.load(
model.sharded_state_dict(), DIR)`` loads at any TP/PP (keys, stacking and layouts as megatron-core
0.16's ``GPTModel.sharded_state_dict()``; fused QKV grouped per KV head, ``linear_fc1`` = gate then
up), plus ``mcore_config.json`` (the matching ``TransformerConfig`` / ``GPTModel`` arguments),
``config.json`` and the tokenizer files, so ``mcore2hf`` and ``from_pretrained`` read it back.

Tensors that need no conversion of dtype are copied straight from the safetensors files into the
output's write buffers (a fused QKV or fc1 is a sequence of row ranges of q/k/v or gate/up), and
written with O_DIRECT while the next buffer is filled; others are read, fused and written one at a
time. Every chunk record carries its CRC32s, the data's computed on the write-behind thread. Memory
stays at a few buffers (and the largest tensor). Everything goes to a temporary folder renamed at
the end.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from conversion._cli import (family_list, fsync_small_files, hf_input_problem,
                             quiet_megatron_import)

__doc__ += f"""
Families: {family_list()}.
"""

with quiet_megatron_import():  # megatron-core warns about optional GPU extras on import
    # every conversion reads an HF config: import transformers' config classes with the other
    # modules (about 1.4 s on a small VM), not inside the conversion
    from transformers import AutoConfig  # noqa: F401

    from parallel_models.config import ConfigError, ModelConfig, resolve_dtype
    from parallel_models.llama.checkpoint_utils.dcp import ChunkItem, write_dist_checkpoint
    from parallel_models.llama.checkpoint_utils.errors import CheckpointError
    from parallel_models.llama.checkpoint_utils.hf_format import (SafetensorsCheckpoint,
                                                                 SafetensorsFileReader,
                                                                 copy_extra_files,
                                                                 resolve_model_path,
                                                                 write_hf_config)
    from parallel_models.llama.checkpoint_utils.megatron_format import (
        LAYER_SPECS, MCORE_CONFIG_FILE, check_megatron_compatible, extra_state_items, mcore_config_dict,
        write_megatron_files)
    from parallel_models.llama.checkpoint_utils.megatron_layout import (DEFAULT_FORMAT,
                                                                        check_format, common_state,
                                                                        tokenizer_source,
                                                                        weights_dir,
                                                                        write_layout_files)
    from parallel_models.llama.checkpoint_utils.checksums import TENSOR_DATA, write_manifest
    from parallel_models.llama.checkpoint_utils.output_dir import AtomicOutputDir, check_output_dir
    from parallel_models.registry import weight_map_of

PROG = "hf2mcore"


def _validate_hf(ckpt: SafetensorsCheckpoint, reader: SafetensorsFileReader, config: ModelConfig,
                 jobs, value_init: bool):
    """Every tensor there with the shape the config gives, every file complete: before writing."""
    for fname in sorted(set(ckpt.files.values())):
        reader.check(fname)
    missing, bad = [], []
    for mapping, layer in jobs:
        for name, shape in zip(mapping.hf_names(layer), mapping.rule.hf_shapes(config)):
            if name not in ckpt:
                if not (value_init and mapping.optional):
                    missing.append(name)
                continue
            got = tuple(ckpt.shape(name))
            if got != tuple(shape):
                bad.append(f"{name}: {got}, the config gives {tuple(shape)}")
    if missing:
        raise CheckpointError(f"{ckpt.folder}: missing tensors: {', '.join(missing[:10])}"
                              + (" ..." if len(missing) > 10 else ""))
    if bad:
        raise CheckpointError(f"{ckpt.folder}: tensor shapes do not match config.json: "
                              + "; ".join(bad[:8]))


def _row_segments(rule, comps, config, locate):
    """The bytes of a megatron chunk made of the HF tensors ``comps`` (``(index in the mapping's
    HF names, name)``) as ``(file, offset, length)`` ranges, in order: the fused QKV (grouped per
    KV head) and ``[gate; up]`` are row ranges of their parts (``rule.mcore_rows``), any other
    tensor is itself.
    None when a tensor cannot be copied verbatim (``locate`` says so: dtype to convert)."""
    pieces = []
    for comp, name in comps:
        where = locate(name)
        if where is None:
            return None
        path, start, shape, row_bytes = where
        row = 0
        for a, b in rule.mcore_rows(comp, 0, shape[0], config):
            pieces.append((a, b, path, start + row * row_bytes, (b - a) * row_bytes))
            row += b - a
    pieces.sort()
    segments = []
    for k, (a, b, path, offset, n) in enumerate(pieces):
        if k and a != pieces[k - 1][1]:
            return None  # not one run of rows (not expected: the general path copes)
        if segments and segments[-1][0] == path and sum(segments[-1][1:]) == offset:
            segments[-1] = (path, segments[-1][1], segments[-1][2] + n)
        else:
            segments.append((path, offset, n))
    return segments


def convert_hf_to_mcore(hf_path: str, output: str, *, dtype=None, layer_spec: str = "te",
                        value: bool = False, threads: int = 1, progress: bool = True,
                        overwrite: bool = False, value_head_seed: int = 0,
                        format: str = DEFAULT_FORMAT) -> dict:
    """Convert; returns ``{"path", "tensors", "bytes", "seconds"}``. Raises CheckpointError /
    ConfigError on bad input before anything is written. ``format``: the folder layout
    (``megatron_layout.FORMATS``)."""
    start = time.perf_counter()
    if layer_spec not in LAYER_SPECS:
        raise ConfigError(f"--layer-spec must be one of {', '.join(LAYER_SPECS)}, got "
                          f"{layer_spec!r}")
    check_format(format)
    check_output_dir(output, overwrite)
    problem = hf_input_problem(hf_path)  # a megatron checkpoint, a file, a missing folder
    if problem:
        raise CheckpointError(problem)
    path = resolve_model_path(hf_path)
    config = ModelConfig.from_hf(path)
    weight_map = weight_map_of(config.architecture)  # unknown architecture -> ConfigError
    is_classifier = config.architecture.endswith("ForSequenceClassification")
    head_kind = "value" if (value or is_classifier) else "causal_lm"
    if is_classifier and getattr(config.hf_config, "num_labels", 1) != 1:
        raise ConfigError(f"{path}: a sequence classifier with num_labels="
                          f"{config.hf_config.num_labels}; only value models (num_labels=1) convert")
    check_megatron_compatible(config)
    out_dtype = resolve_dtype(dtype, None) if dtype is not None else None
    ckpt = SafetensorsCheckpoint(path)
    jobs = weight_map.global_jobs(config, head_kind)
    value_init = head_kind == "value" and any(
        n not in ckpt for m, _ in jobs if m.optional for n in m.hf)
    reader = SafetensorsFileReader()
    try:
        _validate_hf(ckpt, reader, config, jobs, value_init)
    except BaseException:
        reader.close()
        raise
    L = config.num_layers

    def read(name):
        return reader.read(ckpt.files[name], name)

    def locate(name, dt):  # (file, offset, shape, row bytes) of a tensor to copy as it is
        if ckpt.dtype(name) != dt:
            return None
        fname = ckpt.files[name]
        _f, header, base, _size = reader._header(fname)  # (read and checked by _validate_hf)
        info = header[name]
        shape = tuple(info["shape"])
        row = int(torch.Size(shape[1:]).numel()) * dt.itemsize
        return fname, base + info["data_offsets"][0], shape, row

    def value_head():
        gen = torch.Generator().manual_seed(value_head_seed)
        return torch.randn((1, config.hidden_size), generator=gen) * config.initializer_range

    items: list[ChunkItem] = []
    for mapping, layer in jobs:
        rule = mapping.rule
        names = mapping.hf_names(layer)
        # the leading axis: the layer (dense models) or the expert (MoE models, saved per layer)
        key, lead_index, lead_size = mapping.mcore_location(config, layer, layer_spec)
        mshape = rule.mcore_shape(config)
        fresh = value_init and mapping.optional  # the value head, initialized here
        dt = out_dtype or ckpt.dtype("model.embed_tokens.weight" if fresh else names[0])
        lead = (lead_index,) if lead_index is not None else ()
        gshape = ((lead_size,) if lead_index is not None else ()) + tuple(mshape)
        zeros = (0,) * len(mshape)
        sizes = ((1,) if lead_index is not None else ())

        def shaped(t, stacked=lead_index is not None):
            return t.unsqueeze(0) if stacked else t

        if fresh:
            items.append(ChunkItem(key, lead + zeros, sizes + tuple(mshape), gshape, dt,
                                   lambda: value_head()))
            continue
        hf_shapes = rule.hf_shapes(config)
        for block in rule.mcore_blocks(config):  # the chunks megatron-core itself would save
            if len(block) == len(names):
                first_row, rows = 0, mshape[0]

                def resolve(ns=names, r=rule, s=shaped):
                    return s(r.to_mcore([read(n) for n in ns], config))
            else:  # one component stored as one run of rows (gate or up of fc1)
                (comp,) = block
                (first_row, end_row), = rule.mcore_rows(comp, 0, hf_shapes[comp][0], config)
                rows = end_row - first_row

                def resolve(n=names[comp], s=shaped):
                    return s(read(n))
            off = lead + (first_row,) + zeros[1:]
            items.append(ChunkItem(key, off, sizes + (rows, *mshape[1:]), gshape, dt, resolve,
                                   _row_segments(rule, [(c, names[c]) for c in block], config,
                                                 lambda n: locate(n, dt))))
    stats = {"tensors": 0, "bytes": 0}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc=PROG, unit="tensor", file=sys.stderr)

    def on_item(item, nbytes):
        stats["tensors"] += 1
        stats["bytes"] += nbytes
        if bar is not None:
            bar.update(1)

    written_dtype = out_dtype or ckpt.dtype("model.embed_tokens.weight")
    try:
        with AtomicOutputDir(output, overwrite) as root:
            info = mcore_config_dict(config, head_kind=head_kind, dtype=written_dtype,
                                     layer_spec=layer_spec)
            info["source"] = {"hf_path": hf_path, "value_head_initialized": value_init}
            tokenizer = tokenizer_source(hf_path)
            tmp = weights_dir(root, format)  # the dist checkpoint (root, or its iter_0000000)
            os.makedirs(tmp, exist_ok=True)
            io_stats = write_dist_checkpoint(tmp, items, extra_state_items(L, config), threads=threads,
                                             on_item=on_item)
            write_megatron_files(tmp, common_state(info, format, tokenizer))
            # ours (HF config, megatron arguments, tokenizer) in the output folder itself
            write_hf_config(root, config.hf_config, architecture=weight_map.architecture(head_kind),
                            head_kind=head_kind, dtype=written_dtype)
            with open(os.path.join(root, MCORE_CONFIG_FILE), "w") as f:
                json.dump(info, f, indent=2)
            copy_extra_files(path, root)
            write_layout_files(root, format, info, tokenizer)
            fsync_small_files(tmp)
            if tmp != root:
                fsync_small_files(root)
            write_manifest(root, TENSOR_DATA)  # checksums.json: mcore2hf / the server verify it
    finally:
        reader.close()
        if bar is not None:
            bar.close()
    if value_init:
        print(f"{PROG}: {path} has no score.weight: the value head was initialized "
              f"N(0, {config.initializer_range}) with seed {value_head_seed}", file=sys.stderr)
    for note in info["notes"]:
        print(f"{PROG}: note: {note}", file=sys.stderr)
    n_hf = sum(len(mapping.hf) for mapping, _ in jobs)  # HF tensors converted (chunks: stats)
    return {"path": output, "tensors": n_hf, "chunks": stats["tensors"], "bytes": stats["bytes"],
            "seconds": time.perf_counter() - start,
            "direct_read_bytes": io_stats["direct_read_bytes"],  # input not in the page cache
            # CRC32 of the chunk records, computed on the write-behind thread(s)
            "crc_seconds": io_stats["crc_seconds"], "crc_bytes": io_stats["crc_bytes"]}


def build_parser():
    """The command line (``conversion._cli``: the console script parses it before the heavy
    imports of this module)."""
    from conversion._cli import hf2mcore_parser

    return hf2mcore_parser()


def convert_args(args) -> dict:
    """The conversion the parsed command line asks for."""
    return convert_hf_to_mcore(args.hf_path, args.output, dtype=args.dtype,
                               layer_spec=args.layer_spec, value=args.value, threads=args.threads,
                               progress=not args.quiet, overwrite=args.overwrite,
                               format=args.format)


def main(argv=None) -> int:
    from conversion._cli import convert_main

    return convert_main(PROG, build_parser(), argv, convert_args)


if __name__ == "__main__":
    sys.exit(main())
