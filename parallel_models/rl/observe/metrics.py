"""PPO metrics: a JSONL + TensorBoard (+ trackers) logger (global rank 0 only) and a phase timer
that also records peak CUDA memory. The PNG plots are in ``rl/observe/plots.py``.

``metrics.jsonl`` holds one JSON object per step, ``{"step": N, "<name>": float, ...}``, flushed
after every step. A run never leaves duplicate steps: the first step written by a logger drops
lines with ``step >= `` that step (a resumed run, or a fresh run over an old output folder), and
:meth:`MetricsLogger.truncate_after` does the same explicitly. TensorBoard event files go to
``<output_dir>/tensorboard``; their writer is opened with ``purge_step`` so TensorBoard also
discards the old events of the steps written again.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _to_float(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    try:
        import numpy as np

        if isinstance(value, np.generic) and value.size == 1:
            return float(value)
    except ImportError:  # pragma: no cover
        pass
    return None


def read_metrics(jsonl_path: str | os.PathLike) -> list[dict]:
    """All records of a metrics.jsonl file (an unreadable last line, e.g. cut by a crash, is
    skipped)."""
    out = []
    with open(jsonl_path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                logger.warning("%s: skipping an unreadable line", jsonl_path)
    return out


class MetricsLogger:
    """``log(step, {name: float})`` to ``<output_dir>/metrics.jsonl`` and TensorBoard.

    Only global rank 0 writes (checked with ``torch.distributed`` when it is initialized); on the
    other ranks every method is a no-op. Non-numeric values are skipped (with one warning).
    """

    def __init__(self, output_dir: str | os.PathLike, tensorboard: bool = True,
                 filename: str = "metrics.jsonl", resume_step: int | None = None,
                 trackers: list | None = None):
        self.output_dir = os.fspath(output_dir)
        self.path = os.path.join(self.output_dir, filename)
        self.samples_path = os.path.join(self.output_dir, "samples.jsonl")
        self.trackers = list(trackers or [])  # rl/observe/trackers.py (wandb, mlflow): rank 0 only
        self.tb_dir = os.path.join(self.output_dir, "tensorboard")
        self.tensorboard = tensorboard
        self.enabled = _global_rank() == 0
        self._file = None
        self._writer = None
        self._purge_step: int | None = None
        self._started = False
        self._warned: set[str] = set()
        if self.enabled:
            os.makedirs(self.output_dir, exist_ok=True)
        if resume_step is not None:
            self.truncate_after(resume_step)

    # -- writing --
    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        """Write one step; returns the floats written."""
        step = int(step)
        values: dict[str, float] = {}
        for key, value in metrics.items():
            f = _to_float(value)
            if f is None:
                if key not in self._warned:
                    self._warned.add(key)
                    logger.warning("metric %r is not a number (%s); not logged", key,
                                   type(value).__name__)
                continue
            values[str(key)] = f
        if not self.enabled:
            return values
        if not self._started:
            # never leave two records of one step: drop what an earlier run wrote from here on
            self._truncate_file(step - 1)
            if self._purge_step is None:
                self._purge_step = step
            self._started = True
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()
        if self.tensorboard:
            writer = self._tb_writer()
            for key, f in values.items():
                if math.isfinite(f):
                    writer.add_scalar(key, f, step)
            writer.flush()
        for tracker in self.trackers:
            tracker.log_scalars(step, values)
        return values

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """Sample generations (e.g. of a validation): one JSON line per row in
        ``samples.jsonl`` (with the step), a TensorBoard text table, and the trackers' tables."""
        if not self.enabled or not rows:
            return
        with open(self.samples_path, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"step": int(step), **row}) + "\n")
        if self.tensorboard:
            columns = list(rows[0])
            lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_md_cell(r.get(c)) for c in columns) + " |" for r in rows]
            writer = self._tb_writer()
            writer.add_text("val/generations", "\n".join(lines), int(step))
            writer.flush()
        for tracker in self.trackers:
            tracker.log_samples(int(step), rows)

    def _tb_writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.tb_dir, purge_step=self._purge_step)
        return self._writer

    # -- resume --
    def truncate_after(self, step: int) -> int:
        """Drop records with ``step > step`` (call when resuming from checkpoint ``step``);
        later TensorBoard events of those steps are purged too. Returns the records kept."""
        step = int(step)
        if not self.enabled:
            return 0
        kept = self._truncate_file(step)
        self._purge_step = step + 1
        self._started = True
        if self._writer is not None:  # purge_step only acts when a writer opens
            self._writer.close()
            self._writer = None
        return kept

    def _truncate_file(self, step: int) -> int:
        if self._file is not None:
            self._file.close()
            self._file = None
        if not os.path.isfile(self.path):
            return 0
        with open(self.path, encoding="utf-8") as f:
            lines = f.readlines()
        keep = []
        for line in lines:
            if not line.strip():
                continue
            try:
                if int(json.loads(line)["step"]) <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue  # a line cut by a crash
        if len(keep) != len(lines):
            tmp = self.path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(keep)
            os.replace(tmp, self.path)
        return len(keep)

    # -- closing --
    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _md_cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ") if value is not None else ""


class Timer:
    """Time a phase: ``with Timer("gen", timings, memory): ...``.

    Adds the phase's wall seconds to ``timings[name]`` (summing repeated phases). On CUDA it
    synchronizes around the phase, resets the peak-memory counters on entry, and, when a
    ``memory`` dict is given, stores the phase's figures under metric-name suffixes (the
    trainer logs them as ``memory/<suffix>``; repeated phases keep the maximum, retries add up):
    ``<name>_peak_gib`` the peak allocated memory in GiB (also the attribute
    ``peak_memory_gib``; None off CUDA), ``<name>_reserved_gib`` the peak the caching allocator
    reserved (allocated + cached blocks: the gap is fragmentation), ``<name>_alloc_retries``
    the allocations that found no free block, flushed the allocator's cache and retried (each a
    device-wide synchronization: a phase slowed by memory pressure shows them). ``seconds``
    holds the duration.
    """

    def __init__(self, name: str, timings: dict[str, float] | None = None,
                 memory: dict[str, float] | None = None, device: Any = None):
        self.name = name
        self.timings = timings
        self.memory = memory
        self.device = device
        self.seconds = 0.0
        self.peak_memory_gib: float | None = None
        self._cuda = torch.cuda.is_available()
        self._retries = 0

    def __enter__(self) -> "Timer":
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._retries = _alloc_retries(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)
            self.peak_memory_gib = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.seconds = time.perf_counter() - self._start
        if self.timings is not None:
            self.timings[self.name] = self.timings.get(self.name, 0.0) + self.seconds
        if self.memory is not None and self.peak_memory_gib is not None:
            name, memory = self.name, self.memory
            reserved = torch.cuda.max_memory_reserved(self.device) / 2**30
            retries = _alloc_retries(self.device) - self._retries
            memory[f"{name}_peak_gib"] = max(memory.get(f"{name}_peak_gib", 0.0),
                                             self.peak_memory_gib)
            memory[f"{name}_reserved_gib"] = max(memory.get(f"{name}_reserved_gib", 0.0),
                                                 reserved)
            memory[f"{name}_alloc_retries"] = memory.get(f"{name}_alloc_retries", 0) + retries


def _alloc_retries(device) -> int:
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


__all__ = ["MetricsLogger", "Timer", "read_metrics"]
