"""What both converters share: their command lines (parsed before any heavy import, so
``--help`` / ``--version`` / a bad argument answer in a fraction of a second), the output-folder
check, error handling, the final summary line. Imports no conversion module (they import this);
the console scripts are ``conversion.scripts``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import warnings
from typing import Callable

from parallel_models.cli_support import (DTYPE_HELP, add_version_argument, dtype_name,
                                         quiet_third_party)

EXPECTED_ERRORS = ("CheckpointError", "ConfigError", "FileNotFoundError", "NotADirectoryError",
                   "PermissionError", "IsADirectoryError")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def summary_line(prog: str, stats: dict) -> str:
    secs = max(stats["seconds"], 1e-9)
    gbps = stats["bytes"] / secs / 1e9
    return (f"{prog}: {stats['tensors']} tensors, {_human(stats['bytes'])} in {secs:.2f} s "
            f"({gbps:.3f} GB/s) -> {stats['path']}")


def run(prog: str, fn: Callable[[], dict], json_summary: bool = False) -> int:
    """Run a conversion; clear one-line message and a non-zero exit code on bad input."""
    try:
        stats = fn()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; nothing was written", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001
        if type(err).__name__ in EXPECTED_ERRORS or isinstance(err, (OSError, ValueError)):
            print(f"{prog}: error: {err}", file=sys.stderr)
            return 1
        raise
    print(summary_line(prog, stats))
    if json_summary:
        print(json.dumps({k: v for k, v in stats.items()}))
    return 0


@contextlib.contextmanager
def quiet_megatron_import():
    """Silence megatron-core's import-time notes about transformer-engine / apex (GPU extras a
    converter never uses)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
        yield


def fsync_small_files(folder: str, streamed: tuple[str, ...] = (".distcp", ".safetensors")) -> None:
    """fsync the files of ``folder`` written with plain writes (configs, index, tokenizer files):
    the weight files (``streamed``) were fsynced as they were written. Before the folder is
    published, so a crash never leaves a published folder with an empty config."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.endswith(streamed) or not os.path.isfile(path):
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def family_list() -> str:
    """The model families the converters handle, from the family registry (a light import)."""
    from parallel_models.llama.families import all_families

    return ", ".join(f"{f.name} ({f.model_type})" for f in all_families())


# files only a megatron-core / Megatron-LM / Megatron-Bridge checkpoint folder has (torch DCP's
# index, megatron-core's metadata.json, Megatron-LM's tracker)
_MEGATRON_MARKERS = (".metadata", "metadata.json", "latest_checkpointed_iteration.txt")
# an HF hub id: "name" or "org/name" (anything else that is not a local folder is a missing path)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def is_megatron_folder(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m))
                                       for m in _MEGATRON_MARKERS)


def hf_input_problem(path: str) -> str | None:
    """Why ``path`` cannot be hf2mcore's input, found without heavy imports or the network: a
    megatron checkpoint (mcore2hf converts those), a file, or a path that is neither a folder
    nor a hub id. None: a folder, or a hub id to fetch."""
    if is_megatron_folder(path):
        return (f"{path}: is a megatron-core dist checkpoint (Megatron-LM / Megatron-Bridge / "
                "hf2mcore output), not an HF model folder; convert it with "
                f"mcore2hf --mcore-path {path} --output DIR")
    if os.path.isdir(path):
        return None
    if os.path.exists(path):
        return f"{path}: expected a model folder, got a file"
    if not _HUB_ID.match(path) or os.path.isabs(path) or path.startswith(("./", "../", "~")):
        return f"{path}: no such folder (and not a Hugging Face Hub id such as 'org/name')"
    return None


def mcore_input_problem(path: str) -> str | None:
    """Why ``path`` cannot be mcore2hf's input (checked before the heavy imports), or None."""
    if not os.path.isdir(path):
        return (f"{path}: no such folder" if not os.path.exists(path) else
                f"{path}: expected a dist checkpoint folder, got a file")
    if not is_megatron_folder(path) and os.path.isfile(os.path.join(path, "config.json")):
        return (f"{path}: is an HF model folder, not a megatron-core dist checkpoint; convert it "
                f"with hf2mcore --hf-path {path} --output DIR")
    return None


def hf2mcore_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hf2mcore", description="Convert an HF checkpoint (safetensors) of a supported "
        f"family - {family_list()} - to a megatron-core GPTModel dist checkpoint (torch_dist) "
        "loadable at any TP/PP/EP.")
    p.add_argument("--hf-path", required=True,
                   help="HF model folder or hub id, of a family listed above")
    p.add_argument("--output", required=True,
                   help="new (or empty) output folder; an existing one needs --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing non-empty --output folder (once the new one is "
                   "complete)")
    p.add_argument("--dtype", type=dtype_name, default=None, metavar="DTYPE",
                   help=f"cast the weights: {DTYPE_HELP} (default: keep the checkpoint's dtype)")
    p.add_argument("--layer-spec", choices=["te", "mcore-local", "local"], default="te",
                   help="the key names of the layer spec that will load it: 'te' = "
                   "transformer-engine's (Megatron-LM's and Megatron-Bridge's default): norms "
                   "fused into linear_qkv / linear_fc1 (layer_norm_weight), an MoE layer's "
                   "pre-MLP norm as pre_mlp_layernorm.weight; 'mcore-local' = megatron-core's "
                   "local spec (get_gpt_layer_local_spec; its keys map gives every norm the fused "
                   "name, MoE layers too; for a dense model the same as 'te'); 'local' = "
                   "input_layernorm / pre_mlp_layernorm (a local spec without the key map). "
                   "mcore2hf and from_pretrained read all three. Default: te")
    p.add_argument("--value", action="store_true",
                   help="a value model (critic / reward): score.weight -> output_layer.weight "
                   "[1, hidden]; *ForSequenceClassification inputs are value models anyway")
    p.add_argument("--format", choices=["bridge", "megatron-lm", "flat"], default="bridge",
                   help="folder layout: 'bridge' = Megatron-LM's iteration layout "
                   "(latest_checkpointed_iteration.txt, iter_0000000/ with Megatron-LM's args in "
                   "the common state) plus Megatron-Bridge's run_config.yaml: both load it as it "
                   "is; 'megatron-lm' = the same without run_config.yaml; 'flat' = the dist "
                   "checkpoint files in --output itself. Default: bridge")
    p.add_argument("--threads", type=int, default=1,
                   help="files written in parallel, each by a thread with its own buffers "
                   "(about 100 MB each; default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_version_argument(p)
    return p


def mcore2hf_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mcore2hf", description="Convert a megatron-core GPTModel dist checkpoint (torch_dist, "
        "any TP/PP/EP, per-layer or stacked MoE layers; written by hf2mcore, megatron-core, "
        f"Megatron-LM or Megatron-Bridge) of a supported family - {family_list()} - to an HF "
        "folder (safetensors shards + index + config.json).")
    p.add_argument("--mcore-path", required=True,
                   help="dist checkpoint folder (or a Megatron-LM run folder)")
    p.add_argument("--output", required=True,
                   help="new (or empty) output folder; an existing one needs --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing non-empty --output folder (once the new one is "
                   "complete)")
    p.add_argument("--hf-config", default=None,
                   help="folder with the model's HF config.json (default: the one in "
                   "--mcore-path, else rebuilt from Megatron-Bridge's run_config.yaml or the "
                   "Megatron-LM args in the checkpoint's common state)")
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_version_argument(p)
    return p


def output_problem(output: str, overwrite: bool) -> str | None:
    """Why ``output`` cannot receive a conversion (checked before the heavy imports), or None.
    The conversion checks again (``check_output_dir``) for callers of the functions."""
    if os.path.isdir(output) and os.listdir(output) and not overwrite:
        return (f"{output}: output folder exists and is not empty (nothing was written; pass "
                "--overwrite to replace it, or choose a new path)")
    if os.path.exists(output) and not os.path.isdir(output):
        return f"{output}: output path exists and is not a folder"
    return None


def convert_main(prog: str, parser: argparse.ArgumentParser, argv,
                 convert: Callable[[argparse.Namespace], dict]) -> int:
    """A converter's ``main``: parse (nothing heavy imported yet), refuse an output folder in
    use, then an input that is missing or of the other converter, then :func:`run`
    ``convert(args)``."""
    quiet_third_party()
    args = parser.parse_args(argv)
    problem = output_problem(args.output, args.overwrite) or (
        hf_input_problem(args.hf_path) if prog == "hf2mcore" else
        mcore_input_problem(args.mcore_path) if prog == "mcore2hf" else None)
    if problem:
        print(f"{prog}: error: {problem}", file=sys.stderr)
        return 1
    return run(prog, lambda: convert(args))
