"""report.png: look rather than read. Every run's training and validation loss overlaid, and every key whose
plan changes over the run, one panel each. For a sweep (every job, labelled by its overrides) and a single run.
Pure Python (matplotlib, imported for the plot)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tinker_exp.formats import read_jsonl

if TYPE_CHECKING:  # imported when a report is drawn: Hydra imports this module with its plugins at every start
    from tinker_exp.optim.plan import Plan

REPORT = "report.png"


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(row.get("train/step", row.get("step")), row[key]) for row in rows if key in row]
    return [p[0] for p in points], [p[1] for p in points]


def _plan(run_dir: Path) -> Plan | None:
    """The run's plan rebuilt from its plan.json; None (said aloud when the file is there) when it cannot be."""
    from tinker_exp.optim.preview import PLAN_FILE, read_plan_file

    path = run_dir / PLAN_FILE
    if not path.exists():
        return None
    try:
        return read_plan_file(path)
    except (OSError, ValueError, KeyError, TypeError) as e:  # a report never fails a finished run (a ConfigError is a ValueError)
        warnings.warn(f"report: no plan panels for {run_dir}: {type(e).__name__}: {e}", stacklevel=2)
        return None


def _plan_series(plan: Plan | None, key: str) -> tuple[Any, Any]:
    from tinker_exp.optim.preview import plot_steps

    if plan is None or key not in plan.columns:
        return [], []
    steps = plot_steps(plan)  # a long plan decimated, its jumps and phase boundaries kept
    return steps, plan.column(key)[steps]


def write_report(runs: Sequence[tuple[str, Path]], path: Path, title: str) -> Path | None:
    """`runs`: (label, run dir). None when no run logged a step."""
    metrics = {label: read_jsonl(d / "metrics.jsonl") if (d / "metrics.jsonl").exists() else [] for label, d in runs}
    if not any(metrics.values()):
        return None
    plans = {label: _plan(d) for label, d in runs}
    varying = sorted(
        {
            name
            for plan in plans.values()
            if plan is not None
            for name, column in plan.columns.items()
            if not isinstance(column, float) and column.min() != column.max()
        }
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.lines import Line2D

    many = len(metrics) > 6  # a study: the legend goes beside the plot, not over it
    panels = 1 + len(varying)
    fig, axes = plt.subplots(panels, 1, figsize=(12 if many else 8, 3.2 + 1.8 * len(varying)), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [2.2] + [1] * len(varying)})  # fmt: skip
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    loss_ax = axes[0, 0]
    handles = [Line2D([], [], color="0.3", linewidth=1.0, label="train"),
               Line2D([], [], color="0.3", linewidth=1.6, linestyle="--", marker="o", markersize=3, label="val")]  # fmt: skip
    for i, (label, rows) in enumerate(metrics.items()):
        color = colors[i % len(colors)]
        loss_ax.plot(*_series(rows, "train/loss"), color=color, linewidth=1.0, alpha=0.7)
        steps, values = _series(rows, "val/loss")
        if steps:
            loss_ax.plot(steps, values, color=color, linewidth=1.6, linestyle="--", marker="o", markersize=3)
        for ax, key in zip(axes[1:, 0], varying):
            ax.plot(*_plan_series(plans[label], key), color=color, linewidth=1.2)
        handles.append(Line2D([], [], color=color, linewidth=2, label=label))  # one entry per run: its color
    loss_ax.set_ylabel("loss")
    loss_ax.grid(alpha=0.3)
    if many:
        loss_ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        loss_ax.legend(handles=handles, fontsize=7, loc="best")
    for ax, key in zip(axes[1:, 0], varying):
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer step (0 = first)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
