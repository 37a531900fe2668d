"""Plots of a run from its metrics.jsonl: one metric with its moving average
(:func:`plot_reward_curve`), and the run's overview (:func:`plot_training_curves`: reward and
validation accuracy, KL, response length), written as PNG atomically."""

from __future__ import annotations

import os

from parallel_models.rl.observe.metrics import read_metrics


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_reward_curve(jsonl_path: str | os.PathLike, png_path: str | os.PathLike,
                      key: str = "reward/mean", window: int | None = None,
                      title: str | None = None) -> str:
    """Draw ``key`` against step from a metrics.jsonl file, with a trailing moving average
    (``window`` default: a fifth of the steps, 1 to 50); write a PNG and return its path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = [r for r in read_metrics(jsonl_path) if key in r and "step" in r]
    if not records:
        present = sorted({k for r in read_metrics(jsonl_path) for k in r} - {"step"})
        raise ValueError(f"{jsonl_path}: no {key!r} values to plot; keys present: "
                         f"{', '.join(present) or '(none)'}")
    records.sort(key=lambda r: r["step"])
    steps = [r["step"] for r in records]
    values = [float(r[key]) for r in records]
    window = window or max(1, min(50, len(values) // 5))

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(steps, values, marker="o", markersize=3, linewidth=1, alpha=0.5, label=key)
    if window > 1:
        ax.plot(steps, moving_average(values, window), linewidth=2,
                label=f"moving average ({window} steps)")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title or f"{key} per PPO step")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    return _save(fig, png_path)


# panels of the overview: (title, y-axis label, [(metric key, label), ...]); a panel whose keys
# are all absent from the run is left out
OVERVIEW_PANELS = (
    ("reward", "mean reward / accuracy", [("reward/mean", "train reward"),
                                          ("val/reward/mean", "val reward"),
                                          ("val/accuracy", "val accuracy")]),
    ("KL", "KL (nats per token)", [("kl/actor_ref", "KL(actor || ref)"),
                                   ("kl/current_kl", "in-reward KL")]),
    ("response length", "tokens", [("response_length/mean", "mean tokens")]),
)
# validation series: distinct markers and line styles, drawn largest first, so two series with
# the same values (a 0/1 rule reward is its accuracy) both stay visible
VAL_STYLES = ({"marker": "o", "markersize": 9, "linestyle": "-", "fillstyle": "none"},
              {"marker": "x", "markersize": 6, "linestyle": "--"})


def training_curves_figure(jsonl_path: str | os.PathLike, window: int | None = None,
                           title: str | None = None):
    """The overview as a matplotlib ``Figure``: one panel per :data:`OVERVIEW_PANELS` entry that
    the run logged (training curves with a moving average, validation points as markers), each
    with its y-axis label, under ``title`` (default: the metrics file's folder, the run)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    records = sorted((r for r in read_metrics(jsonl_path) if "step" in r), key=lambda r: r["step"])
    panels = [(name, ylabel, [(k, lbl) for k, lbl in keys if any(k in r for r in records)])
              for name, ylabel, keys in OVERVIEW_PANELS]
    panels = [p for p in panels if p[2]]
    if not panels:
        raise ValueError(f"{jsonl_path}: none of the plotted metrics were logged")
    fig = Figure(figsize=(5 * len(panels), 4.4), dpi=100)
    FigureCanvasAgg(fig)
    for i, (name, ylabel, keys) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        val_styles = iter(VAL_STYLES * len(keys))
        for key, label in keys:
            pts = [(r["step"], float(r[key])) for r in records if key in r]
            steps, values = [p[0] for p in pts], [p[1] for p in pts]
            if key.startswith("val/"):
                ax.plot(steps, values, linewidth=1.5, label=label, **next(val_styles))
                continue
            ax.plot(steps, values, marker="o", markersize=2, linewidth=1, alpha=0.4, label=label)
            w = window or max(1, min(50, len(values) // 5))
            if w > 1:
                ax.plot(steps, moving_average(values, w), linewidth=2, label=f"{label} ({w}-step avg)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    run = title or os.path.basename(os.path.dirname(os.path.abspath(jsonl_path)))
    fig.suptitle(run)
    fig.tight_layout()
    return fig


def plot_training_curves(jsonl_path: str | os.PathLike, png_path: str | os.PathLike,
                         window: int | None = None, title: str | None = None) -> str:
    """:func:`training_curves_figure` written as a PNG; returns its path."""
    return _save(training_curves_figure(jsonl_path, window, title), png_path)


def _save(fig, png_path) -> str:
    png_path = os.fspath(png_path)
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    tmp = png_path + ".tmp"
    fig.savefig(tmp, format="png")
    os.replace(tmp, png_path)
    return png_path


__all__ = ["plot_reward_curve", "plot_training_curves", "training_curves_figure", "moving_average",
           "OVERVIEW_PANELS"]
