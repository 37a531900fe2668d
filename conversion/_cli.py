"""What both converters share: error handling, the final summary line."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from typing import Callable

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
