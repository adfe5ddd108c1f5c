"""See the plan before spending GPU hours: a compact table, plan.jsonl (every step) and a PNG plot.

No torch, verl or ray (matplotlib only, imported for the plot).
"""

from __future__ import annotations

import json
from pathlib import Path

from tinker_exp.formats import text_table
from tinker_exp.optim.convert import flat_values
from tinker_exp.optim.plan import Plan


def table_steps(plan: Plan) -> list[int]:
    """First steps, each phase boundary and the step before it, and the last step."""
    last = len(plan) - 1
    steps = {0, 1, 2, last}
    for boundary in plan.boundaries():
        steps |= {boundary - 1, boundary}
    return sorted(step for step in steps if 0 <= step <= last)


def plan_table(plan: Plan) -> tuple[list[str], list[list]]:
    columns = list(flat_values("", plan[0]))
    rows = [[step, *flat_values("", plan[step]).values()] for step in table_steps(plan)]
    return ["step", *columns], rows


def format_table(plan: Plan) -> str:
    header, rows = plan_table(plan)
    if len(header) == 1:
        return "no override: nothing is sent with optimizer_step"
    table = text_table(header, [[str(row[0])] + [f"{v:.6g}" for v in row[1:]] for row in rows])
    phases = ", ".join(f"{label}: {s.kind} over {s.total_steps} steps" for label, s in plan.schedules.items())
    return "\n".join([table, *([phases] if phases else [])])


def write_plan_jsonl(plan: Plan, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for step, params in enumerate(plan.steps):
            f.write(json.dumps({"step": step, **flat_values("", params)}) + "\n")


def plot_plan(plan: Plan, path: Path) -> Path | None:
    """One panel per value sent; None when nothing is sent."""
    keys = list(flat_values("", plan[0]))
    if not keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {key: [] for key in keys}
    for params in plan.steps:
        for key, value in flat_values("", params).items():
            series[key].append(value)
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 1.8 * len(keys) + 0.6), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        ax.plot(range(len(plan)), series[key], linewidth=1.2)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        for boundary in plan.boundaries():
            ax.axvline(boundary, color="grey", linewidth=0.6, linestyle=":")
    axes[-1, 0].set_xlabel("optimizer step (0 = first)")
    fig.suptitle("override plan")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
