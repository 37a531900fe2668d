"""mcore2hf: a megatron-core ``GPTModel`` dist checkpoint (torch_dist, saved at any TP/PP by
megatron-core, Megatron-LM, ``hf2mcore`` or ``save_mcore``) -> an HF folder that
``transformers.AutoModelForCausalLM.from_pretrained`` loads (value models:
``AutoModelForSequenceClassification``).

    mcore2hf --mcore-path DIR --output DIR [--overwrite] [--hf-config DIR]

``--hf-config``: a folder with the model's HF ``config.json`` (its tokenizer files are copied
too). Without it: the ``config.json`` next to the dist checkpoint, else the HF config rebuilt from
Megatron-Bridge's ``run_config.yaml`` or the Megatron-LM ``args`` in the common state
(``megatron_hf_config``). A Megatron-LM / Bridge run folder (with
``latest_checkpointed_iteration.txt``) resolves to its latest iteration. Every norm naming
(transformer-engine, megatron-core's local spec, module names) and both layer layouts (stacked
under one key, as megatron-core and Megatron-Bridge save an every-layer MoE model, or one key per
layer) are read, at any TP / PP / EP. Each HF tensor is assembled from the chunks
that hold it and streamed into size-limited safetensors shards; everything goes to a temporary
folder renamed at the end. Tensors whose rows lie whole in contiguously stored chunks (hf2mcore's
output, megatron-core's at TP=1) are copied straight from the chunk files into the output's write
buffers (QKV / fc1 parts as row ranges), written with O_DIRECT while the next buffer is filled.
"""

from __future__ import annotations

import os
import sys
import time

from conversion._cli import fsync_small_files, quiet_megatron_import

with quiet_megatron_import():  # megatron-core warns about optional GPU extras on import
    # every conversion reads an HF config: import transformers' config classes with the other
    # modules (about 1.4 s on a small VM), not inside the conversion
    from transformers import AutoConfig  # noqa: F401

    from parallel_models.config import ModelConfig
    from parallel_models.llama.checkpoint_utils.direct_io import (RangeReader, WriteBehind,
                                                                 segment_filler)
    from parallel_models.llama.checkpoint_utils.errors import CheckpointError
    from parallel_models.llama.checkpoint_utils.hf_format import (ShardedSafetensorsWriter,
                                                                 _nbytes, copy_extra_files,
                                                                 write_hf_config)
    from parallel_models.llama.checkpoint_utils.mcore_reader import (McoreCheckpoint,
                                                                    config_of_mcore_dir)
    from parallel_models.llama.checkpoint_utils.megatron_format import (layout_root,
                                                                       resolve_mcore_dir)
    from parallel_models.llama.checkpoint_utils.checksums import (TENSOR_DATA, ChecksumMismatch,
                                                                   verify_manifest, write_manifest)
    from parallel_models.llama.checkpoint_utils.output_dir import AtomicOutputDir, check_output_dir
    from parallel_models.registry import weight_map_of

PROG = "mcore2hf"


class StreamingShardsWriter(ShardedSafetensorsWriter):
    """The same safetensors shards and index, each file streamed through a :class:`WriteBehind`
    (reused buffers, O_DIRECT, fsync on its thread); :meth:`write_ranges` takes a tensor as byte
    ranges of files, read straight into the write buffers."""

    def __init__(self, folder, specs, max_shard_size, wb: WriteBehind):
        super().__init__(folder, specs, max_shard_size)
        self.wb = wb

    def _open_file(self, path: str):  # the base class writes the header through it
        return self.wb.open(path)

    def _close_shard(self) -> None:
        self.handle.close()  # tail, fsync and close on the write-behind thread
        self.handle = None

    def write_ranges(self, name: str, ranges: list[tuple[str, int, int]],
                     reader: RangeReader) -> None:
        if self.next >= len(self.specs) or self.specs[self.next][0] != name:
            raise CheckpointError(f"internal: got tensor {name!r}, expected {self.expected!r}")
        _, shape, dtype = self.specs[self.next]
        nbytes = sum(n for _, _, n in ranges)
        if nbytes != _nbytes(shape, dtype):
            raise CheckpointError(f"internal: {name}: {nbytes} bytes, planned "
                                  f"{_nbytes(shape, dtype)}")
        k = self.shard_of[self.next]
        if self.handle is None:
            self._open_shard(k)
        self.handle.fill(nbytes, segment_filler(reader, ranges))
        self.bytes_written += nbytes
        self.next += 1
        if self.next == len(self.specs) or self.shard_of[self.next] != k:
            self._close_shard()

    def abort(self) -> None:
        if self.handle is not None:
            self.handle.abort()
            self.handle = None


def convert_mcore_to_hf(mcore_path: str, output: str, *, hf_config: str | None = None,
                        max_shard_size: int | str = "5GB", progress: bool = True,
                        overwrite: bool = False) -> dict:
    """Convert; returns ``{"path", "tensors", "bytes", "seconds"}``. Raises CheckpointError /
    ConfigError on bad input before anything is written."""
    start = time.perf_counter()
    check_output_dir(output, overwrite)
    folder = resolve_mcore_dir(mcore_path)
    for root in {os.path.abspath(mcore_path), os.path.abspath(folder)}:
        try:  # hf2mcore's checksums.json (where present): damaged data is refused, named
            verify_manifest(root)
        except ChecksumMismatch as err:
            raise CheckpointError(f"{err}; the checkpoint is damaged: convert or copy it "
                                  "again") from None
    if hf_config is not None:
        if not os.path.isdir(hf_config):
            raise CheckpointError(f"--hf-config {hf_config}: not a folder (give the folder that "
                                  "holds config.json)")
        config = ModelConfig.from_hf(hf_config)
    else:  # config.json, else rebuilt from a Bridge run_config.yaml or Megatron-LM args
        config = config_of_mcore_dir(folder)
    weight_map = weight_map_of(config.architecture)
    ckpt = McoreCheckpoint(folder, weight_map, config)
    jobs = weight_map.global_jobs(config, ckpt.head_kind)
    names = [n for mapping, layer in jobs for n in mapping.hf_names(layer)]
    ckpt.validate(names)  # every key, shape, file and byte range, before writing anything
    specs = [(n, tuple(ckpt.shape(n)), ckpt.dtype(n)) for n in names]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(names), desc=PROG, unit="tensor", file=sys.stderr)
    reader = RangeReader()
    try:
        with AtomicOutputDir(output, overwrite) as tmp:
            wb = WriteBehind()
            writer = StreamingShardsWriter(tmp, specs, max_shard_size, wb)
            try:
                for name in names:
                    ranges = ckpt.byte_ranges(name, reader)
                    if ranges is not None:  # rows stored contiguously: copied as they are
                        writer.write_ranges(name, ranges, reader)
                    else:  # e.g. split by columns (row-parallel TP shards): assembled
                        writer.write(name, ckpt(name, None, None, None))
                    if bar is not None:
                        bar.update(1)
                writer.close()
                wb.finish()
            except BaseException:
                writer.abort()
                wb.abort()
                raise
            write_hf_config(tmp, config.hf_config,
                            architecture=weight_map.architecture(ckpt.head_kind),
                            head_kind=ckpt.head_kind, dtype=ckpt.dtype("model.embed_tokens.weight"))
            copy_extra_files(layout_root(folder) or folder, tmp)  # beside the tracker, if any
            if hf_config is not None:
                copy_extra_files(hf_config, tmp)
            fsync_small_files(tmp)
            write_manifest(tmp, TENSOR_DATA)  # this folder's own (replaces a copied one)
    finally:
        if bar is not None:
            bar.close()
        reader.close()
        ckpt.close()
    return {"path": output, "tensors": len(names), "bytes": writer.bytes_written,
            "seconds": time.perf_counter() - start,
            "direct_read_bytes": reader.direct_bytes}  # input not in the page cache


def build_parser():
    """The command line (``conversion._cli``: the console script parses it before the heavy
    imports of this module)."""
    from conversion._cli import mcore2hf_parser

    return mcore2hf_parser()


def convert_args(args) -> dict:
    """The conversion the parsed command line asks for."""
    return convert_mcore_to_hf(args.mcore_path, args.output, hf_config=args.hf_config,
                               max_shard_size=args.max_shard_size, progress=not args.quiet,
                               overwrite=args.overwrite)


def main(argv=None) -> int:
    from conversion._cli import convert_main

    return convert_main(PROG, build_parser(), argv, convert_args)


if __name__ == "__main__":
    sys.exit(main())
