"""fit.png: each run's measured curve and the law's curve over every step.

The measured points and the law's line in the same colour, labelled by run and its final-loss error; the lr of each run
below. matplotlib, imported when drawn."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tinker_exp.forecast.fit import Law
from tinker_exp.forecast.laws import warmup_end
from tinker_exp.forecast.runs import Curve, updates_seen


MAX_DRAWN = 1000  # the law's line at this many steps at most: at every step of a 24,000-step cosine it takes minutes


def write_fit_png(law: Law, curves: list[Curve], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, lr_ax) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    errors = {r["run"]: r for r in law.record.get("fit", {}).get("runs", [])}
    for i, curve in enumerate(curves):
        color = f"C{i % 10}"
        steps = np.unique(np.linspace(0, len(curve.lr) - 1, min(len(curve.lr), MAX_DRAWN)).astype(np.int64))
        updates = np.clip(updates_seen(law.metric, steps), 1, len(curve.lr))
        shown = updates_seen(law.metric, steps) > warmup_end(curve.lr)  # the law holds from the peak on
        error = errors.get(curve.name)
        final = f"mean of last {law.final_window}" if law.final_window > 1 else "final"
        label = curve.name + (f" ({final} {error['actual']:.3f}, law's error {error['final_error']:+.3f})" if error else "")
        loss_ax.plot(curve.steps, curve.loss, ".", color=color, markersize=3.5 if len(curve.steps) < 200 else 2.5, alpha=0.5)
        loss_ax.plot(steps[shown], law.curve(curve.lr, updates[shown]), "-", color=color, linewidth=1.4, label=label)
        lr_ax.plot(np.arange(len(curve.lr)), curve.lr, color=color, linewidth=1.0)
    if law.from_step:
        loss_ax.axvline(law.from_step, color="0.4", linestyle=":", linewidth=1.0, label=f"fitted from step {law.from_step}")
    low = min(float(np.percentile(c.loss, 1)) for c in curves)
    high = max(float(np.percentile(c.loss[c.steps > law.warmup_steps], 99)) if np.any(c.steps > law.warmup_steps) else float(c.loss.max()) for c in curves)
    loss_ax.set_ylim(low - 0.05 * (high - low), high + 0.1 * (high - low))  # the warmup's first losses off the top
    loss_ax.set_ylabel(f"{law.metric} (dots measured, lines {law.kind} law)")
    loss_ax.legend(fontsize=7, loc="upper right")
    loss_ax.grid(alpha=0.3)
    loss_ax.set_title(title, fontsize=9)
    lr_ax.set_ylabel("applied/lr")
    lr_ax.set_xlabel("optimizer step")
    lr_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
