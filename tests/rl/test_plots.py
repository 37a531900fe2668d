"""The run's overview plot (reward_curve.png) reads on its own: every panel has a y-axis label,
the figure names the run, and a validation series that equals another one (a 0/1 rule reward is
its accuracy) is not hidden under it."""

from __future__ import annotations

import json

from parallel_models.rl.observe.plots import plot_training_curves, training_curves_figure


def _metrics(path):
    with open(path, "w") as f:
        for step in range(1, 11):
            row = {"step": step, "reward/mean": 0.1 * step, "kl/actor_ref": 0.01 * step,
                   "response_length/mean": 5.0 + step}
            if step % 5 == 0:  # validation every 5 steps: reward == accuracy
                row.update({"val/reward/mean": 0.05 * step, "val/accuracy": 0.05 * step})
            f.write(json.dumps(row) + "\n")
    return path


def test_overview_has_labels_title_and_visible_validation_lines(tmp_path):
    jsonl = _metrics(tmp_path / "metrics.jsonl")
    fig = training_curves_figure(jsonl, title="my-run")
    assert fig._suptitle is not None and fig._suptitle.get_text() == "my-run"
    axes = fig.get_axes()
    assert [ax.get_title() for ax in axes] == ["reward", "KL", "response length"]
    assert all(ax.get_ylabel() for ax in axes), [ax.get_ylabel() for ax in axes]
    lines = {line.get_label(): line for line in axes[0].get_lines()}
    val_reward, val_acc = lines["val reward"], lines["val accuracy"]
    assert list(val_reward.get_ydata()) == list(val_acc.get_ydata())  # the same points
    # drawn first (underneath) with larger hollow markers, the second in another marker and
    # line style: both are seen
    order = axes[0].get_lines()
    assert order.index(val_reward) < order.index(val_acc)
    assert val_reward.get_markersize() > val_acc.get_markersize()
    assert val_reward.get_fillstyle() == "none"
    assert val_reward.get_marker() != val_acc.get_marker()
    assert val_reward.get_linestyle() != val_acc.get_linestyle()
    # the default title is the run's folder
    assert training_curves_figure(jsonl)._suptitle.get_text() == tmp_path.name
    png = plot_training_curves(jsonl, tmp_path / "curve.png", title="my-run")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
