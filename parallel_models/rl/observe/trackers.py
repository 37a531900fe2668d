"""Experiment trackers through their own libraries: Weights & Biases and MLflow.

``trainer.loggers`` names where metrics go: ``jsonl`` and ``tensorboard`` are written by
:class:`parallel_models.rl.observe.metrics.MetricsLogger` itself; ``wandb`` and ``mlflow`` are the
trackers here (optional extras: ``pip install -e '.[trackers]'`` in a clone). Each tracker takes
scalars per step, sample generations as a table, and the run's resolved config once.

* wandb: ``wandb.init(project=trainer.project_name, name=trainer.experiment_name, dir=output_dir,
  config=...)``; its usual environment applies (``WANDB_MODE=offline`` writes the run under
  ``output_dir/wandb`` without a network, ``wandb sync`` uploads it later).
* mlflow: the tracking URI from ``MLFLOW_TRACKING_URI`` (default: a local store in
  ``output_dir/mlruns``, mlflow's file store), experiment ``trainer.project_name``, run name
  ``trainer.experiment_name``; samples go to the run as a JSON table artifact.

Only global rank 0 creates trackers (the caller checks).
"""

from __future__ import annotations

import math
import os
from typing import Any, Protocol, Sequence

BUILTIN_LOGGERS = ("jsonl", "tensorboard")
TRACKERS = ("wandb", "mlflow")


class Tracker(Protocol):
    def log_config(self, config: dict) -> None: ...

    def log_scalars(self, step: int, values: dict[str, float]) -> None: ...

    def log_samples(self, step: int, rows: Sequence[dict]) -> None: ...

    def close(self) -> None: ...


def _missing(name: str, err: ImportError) -> ImportError:
    return ImportError(f"trainer.loggers includes {name!r} but {name} is not installed "
                       f"({err}); pip install -e '.[trackers]' in a clone (or pip install {name})")


class WandbTracker:
    def __init__(self, output_dir: str, project: str, name: str | None, config: dict | None):
        try:
            import wandb
        except ImportError as err:
            raise _missing("wandb", err) from err
        self._wandb = wandb
        os.makedirs(output_dir, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=output_dir, config=config or {},
                              reinit="finish_previous")

    def log_config(self, config: dict) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log({k: v for k, v in values.items() if math.isfinite(v)}, step=step)

    def log_samples(self, step: int, rows: Sequence[dict]) -> None:
        if not rows:
            return
        columns = list(rows[0])
        table = self._wandb.Table(columns=columns,
                                  data=[[_cell(r.get(c)) for c in columns] for r in rows])
        self.run.log({"val/generations": table}, step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() can return before wandb's service process has written the run file (seen
        # offline under load); teardown waits for the service to flush and exit
        self._wandb.teardown()


class MlflowTracker:
    def __init__(self, output_dir: str, project: str, name: str | None, config: dict | None):
        try:
            import mlflow
        except ImportError as err:
            raise _missing("mlflow", err) from err
        self._mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            store = os.path.abspath(os.path.join(output_dir, "mlruns"))
            os.makedirs(store, exist_ok=True)
            # mlflow 3 keeps its file store only on request; a local run needs no database
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri("file://" + store)
        mlflow.set_experiment(project)
        self.run = mlflow.start_run(run_name=name)
        if config:
            self.log_config(config)

    def log_config(self, config: dict) -> None:
        flat = _flatten(config)
        self._mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        clean = {_mlflow_key(k): v for k, v in values.items() if math.isfinite(v)}
        if clean:
            self._mlflow.log_metrics(clean, step=step)

    def log_samples(self, step: int, rows: Sequence[dict]) -> None:
        if rows:
            columns = list(rows[0])
            table = {c: [_cell(r.get(c)) for r in rows] for c in columns}
            self._mlflow.log_dict(table, f"generations/step_{step:06d}.json")

    def close(self) -> None:
        self._mlflow.end_run()


def _cell(value: Any):
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


def _mlflow_key(key: str) -> str:
    # mlflow allows alphanumerics, _ - . space : / ; anything else becomes _
    return "".join(ch if ch.isalnum() or ch in "_-. :/" else "_" for ch in key)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def build_trackers(names: Sequence[str], output_dir: str, project: str,
                   experiment: str | None = None, config: dict | None = None) -> list[Tracker]:
    """The external trackers among ``names`` (``jsonl``/``tensorboard`` are not trackers here);
    an unknown name raises naming the valid ones."""
    unknown = [n for n in names if n not in BUILTIN_LOGGERS + TRACKERS]
    if unknown:
        raise ValueError(f"trainer.loggers: unknown logger(s) {unknown}; valid: "
                         f"{', '.join(BUILTIN_LOGGERS + TRACKERS)}")
    classes = {"wandb": WandbTracker, "mlflow": MlflowTracker}
    return [classes[n](output_dir, project, experiment, config) for n in names if n in classes]


__all__ = ["Tracker", "WandbTracker", "MlflowTracker", "build_trackers", "BUILTIN_LOGGERS",
           "TRACKERS"]
