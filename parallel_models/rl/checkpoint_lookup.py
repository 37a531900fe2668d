"""Finding the trainer checkpoint to resume, and checking a folder before anything is loaded.

- :func:`read_checkpoint_state`: is a folder a complete trainer checkpoint (its state file, the
  dist checkpoint's index)? returns its trainer state;
- :func:`latest_checkpoint`: the folder ``checkpoints/latest`` names, checked (complete, and its
  files' checksums, :mod:`~parallel_models.llama.checkpoint_utils.checksums`). When that folder cannot be
  resumed it is an error naming the folder, unless ``fallback`` (``--resume-fallback`` /
  ``trainer.resume_fallback``) asks for the newest usable older step, with a loud warning naming
  the steps that are dropped;
- :func:`choose_checkpoint`: the same decision made once, on rank 0, and shared with every rank;
- :func:`save_failed`: a failed save (disk full, a failed write) as one message naming the file.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re

from parallel_models.config import ConfigError
from parallel_models.llama.checkpoint_utils.errors import CheckpointError
from parallel_models.llama.checkpoint_utils.checksums import ChecksumMismatch, verify_manifest

logger = logging.getLogger(__name__)

FORMAT = "parallel_models.trainer_checkpoint/1"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
LATEST_FILE = "latest"
DIST_DIR = "dist"
RNG_DIR = "rng"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class TrainerCheckpointError(CheckpointError, ConfigError):
    """A folder cannot be resumed from (names the folder and what is wrong)."""


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def step_folders(root: str) -> list[str]:
    """The ``step_N`` folders of ``root``, newest first."""
    steps = [(int(m.group(1)), d) for d in glob.glob(os.path.join(root, "step_*"))
             if (m := _STEP_DIR.match(os.path.basename(d))) and os.path.isdir(d)]
    return [d for _, d in sorted(steps, reverse=True)]


def read_checkpoint_state(path: str) -> dict:
    """Check that ``path`` is a complete trainer checkpoint; returns its trainer state."""
    from parallel_models.llama.checkpoint_utils.dcp import read_dcp_metadata
    from parallel_models.llama.checkpoint_utils.megatron_format import MEGATRON_METADATA

    if not os.path.isdir(path):
        raise TrainerCheckpointError(f"{path}: no such checkpoint folder")
    base = os.path.basename(os.path.normpath(path))
    if ".tmp" in base:
        raise TrainerCheckpointError(
            f"{path}: a temporary folder of a checkpoint save that did not finish (partial); "
            "resume from a complete step_N folder")
    state_file = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state_file):
        raise TrainerCheckpointError(f"{path}: not a trainer checkpoint (no {STATE_FILE})")
    try:
        with open(state_file) as f:
            state = json.load(f)
    except (OSError, ValueError) as err:
        raise TrainerCheckpointError(f"{state_file}: unreadable ({err})") from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise TrainerCheckpointError(
            f"{state_file}: not a {FORMAT} checkpoint (format "
            f"{state.get('format') if isinstance(state, dict) else None!r}); checkpoints of "
            "older versions (per-rank files) cannot be resumed")
    dist_dir = os.path.join(path, DIST_DIR)
    needs = [".metadata"] + ([MEGATRON_METADATA] if state.get("backend", "megatron") == "megatron"
                             else [])
    for needed in (os.path.join(dist_dir, name) for name in needs):
        if not os.path.isfile(needed):
            raise TrainerCheckpointError(f"{path}: incomplete checkpoint, {needed} is missing")
    try:
        state["_tensors"] = {k: tuple(v.size) for k, v in
                             read_dcp_metadata(dist_dir).state_dict_metadata.items()
                             if hasattr(v, "size")}
    except CheckpointError as err:
        raise TrainerCheckpointError(f"{path}: {err}") from err
    return state


def check_usable(path: str) -> dict:
    """:func:`read_checkpoint_state` and the files' checksums; returns the trainer state."""
    state = read_checkpoint_state(path)
    try:
        verify_manifest(path)
    except ChecksumMismatch as err:
        raise TrainerCheckpointError(f"{path} is damaged: {err}") from err
    return state


def _pointed(root: str) -> str | None:
    """The folder ``root/latest`` names (None without a ``latest`` file)."""
    pointer = os.path.join(root, LATEST_FILE)
    if not os.path.isfile(pointer):
        return None
    try:
        with open(pointer) as f:
            name = json.load(f)["latest"]
        if not isinstance(name, str) or os.sep in name or not _STEP_DIR.match(name):
            raise ValueError(f"names {name!r}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise TrainerCheckpointError(f"{pointer}: unreadable ({err})") from err
    return os.path.join(root, name)


def newest_checkpoint_candidate(root: str) -> str | None:
    """The folder a resume would try first (``latest``'s, else the newest ``step_N`` with a
    state file), unchecked; None when there is none. Cheap: no file is read but ``latest``."""
    try:
        pointed = _pointed(root)
    except TrainerCheckpointError:
        pointed = None
    if pointed is not None and os.path.isdir(pointed):
        return pointed
    complete = [d for d in step_folders(root) if os.path.isfile(os.path.join(d, STATE_FILE))]
    return complete[0] if complete else pointed


def latest_checkpoint(root: str, fallback: bool = False) -> str | None:
    """The checkpoint to resume: the folder ``root/latest`` names (else, with no ``latest``, the
    newest ``step_N``), checked; None when ``root`` has none. An unusable one is an error naming
    it unless ``fallback``: then the newest usable older step, with a warning."""
    try:
        first = _pointed(root)
    except TrainerCheckpointError as err:
        if not fallback:
            raise TrainerCheckpointError(f"{err}; --resume-fallback resumes the newest usable "
                                         "step folder instead") from err
        first, problem = None, str(err)
    candidates = step_folders(root)
    if first is not None:
        candidates = [first] + [d for d in candidates
                                if os.path.abspath(d) != os.path.abspath(first)]
    elif not fallback:  # no latest: a save cut before it was written; the newest complete step
        candidates = [d for d in candidates if os.path.isfile(os.path.join(d, STATE_FILE))]
    skipped = []
    for path in candidates:
        try:
            check_usable(path)
        except TrainerCheckpointError as err:
            if not fallback:
                raise TrainerCheckpointError(
                    f"cannot resume the latest checkpoint: {err}. Nothing was loaded; "
                    "--resume-fallback (trainer.resume_fallback=true) resumes the newest usable "
                    "older step instead") from err
            skipped.append(f"{path} ({err})")
            continue
        if skipped or (first is None and os.path.isfile(os.path.join(root, LATEST_FILE))):
            logger.warning("!!! --resume-fallback: the latest checkpoint cannot be resumed; "
                           "resuming the older %s instead, the steps after it will be redone. "
                           "Skipped: %s", path, "; ".join(skipped) or problem)
        return path
    if skipped:
        raise TrainerCheckpointError(f"{root}: no usable checkpoint (" + "; ".join(skipped) + ")")
    return None


def choose_checkpoint(root: str, path: str | None, fallback: bool) -> str | None:
    """On rank 0: ``path`` checked, or :func:`latest_checkpoint`; every rank gets the answer
    (a folder, None, or the same TrainerCheckpointError)."""
    import torch.distributed as dist

    choice = [None, None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            if path is not None:
                check_usable(path)
                choice[0] = path
            else:
                choice[0] = latest_checkpoint(root, fallback)
        except TrainerCheckpointError as err:
            choice[1] = str(err)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    if choice[1] is not None:
        raise TrainerCheckpointError(choice[1])
    return choice[0]


def _causes(err: BaseException):
    """``err``, its causes and contexts, and the per-rank failures a torch.distributed.checkpoint
    ``CheckpointException`` carries."""
    todo, seen = [err], set()
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        todo += [pair[0] for pair in (getattr(e, "failures", None) or {}).values()
                 if isinstance(pair, tuple) and pair]


def _write_probe(folder: str, size: int = 4 << 20) -> str | None:
    """Why writing ``size`` bytes into ``folder`` fails now (a full disk, a size limit), or None.
    A failed write inside torch's zip writer loses the OSError; this finds the reason again."""
    path = os.path.join(folder, f".write-probe-{os.getpid()}")
    try:
        with open(path, "wb") as f:
            for _ in range(size >> 20):
                f.write(bytes(1 << 20))
            f.flush()
            os.fsync(f.fileno())
        return None
    except OSError as err:
        return err.strerror or str(err)
    finally:
        try:
            os.remove(path)
        except OSError:
            pass


def save_failed(final: str, tmp: str, err: BaseException) -> TrainerCheckpointError:
    """A failed save as one message: which file (or folder), why, what to do."""
    if isinstance(err, TrainerCheckpointError):
        return err
    causes = list(_causes(err))
    oserror = next((e for e in causes if isinstance(e, OSError) and e.strerror), None)
    where = next((str(e.filename) for e in causes if isinstance(e, OSError) and e.filename), tmp)
    reason = oserror.strerror if oserror is not None else _write_probe(os.path.dirname(final))
    if reason is None:
        root = causes[-1] if len(causes) > 1 else err
        text = str(root).strip().splitlines()
        reason = f"{type(root).__name__}: {text[-1] if text else ''}"
    return TrainerCheckpointError(
        f"saving the checkpoint {final} failed while writing {where}: {reason}. Nothing was "
        "saved (the partial files are removed; the previous checkpoint is intact): free disk "
        "space or fix the folder, then continue with --resume")
