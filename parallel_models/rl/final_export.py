"""The record of a run's final HF export (``actor_hf/``, ``critic_hf/``): ``final_export.json``.

The trainer writes it once the export of the last step is complete. A ``--resume`` of a finished
run whose record is missing or names another step (killed between the last checkpoint and the end
of the export) exports again instead of answering "finished" with no ``actor_hf``.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

from parallel_models.utils.fault_points import fault_point

EXPORT_RECORD = "final_export.json"
EXPORT_FOLDERS = ("actor_hf", "critic_hf")


def remove_stale_exports(output_dir: str) -> list[str]:
    """The hidden temporary folders of exports that were killed (one run per folder, so none is
    being written now); returns the removed paths."""
    stale = [p for name in EXPORT_FOLDERS
             for p in glob.glob(os.path.join(glob.escape(output_dir), f".{name}.tmp-*"))]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def export_done(output_dir: str, step: int) -> bool:
    """True when the final export of ``step`` finished in ``output_dir``."""
    try:
        with open(os.path.join(output_dir, EXPORT_RECORD)) as f:
            record = json.load(f)
        return record["step"] == step and all(
            os.path.isfile(os.path.join(output_dir, d, "config.json")) for d in record["folders"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def record_export(output_dir: str, step: int) -> str:
    """Write the record (atomically) after the export of ``step``; returns its path."""
    fault_point("export:before_record")
    folders = [d for d in EXPORT_FOLDERS if os.path.isdir(os.path.join(output_dir, d))]
    path = os.path.join(output_dir, EXPORT_RECORD)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"step": step, "folders": folders}, f)
    os.replace(tmp, path)
    return path
