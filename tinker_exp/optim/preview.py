"""See the plan before spending GPU hours: a compact table, plan.json and a PNG plot.

plan.json holds the plan in a form a person reads and the plan is rebuilt from.

numpy only, no torch, verl or ray (matplotlib, imported for the plot).

    python -m tinker_exp.optim.preview RUN_DIR/plan.json [STEP ...]   # the table, with these steps too
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tinker_exp.formats import display_name, text_table
from tinker_exp.optim.convert import flat_values
from tinker_exp.optim.plan import Plan, override_config, plan_for
from tinker_exp.optim.schedules import Schedule


def table_steps(plan: Plan, extra: Iterable[int] = ()) -> list[int]:
    """First steps, each phase boundary and the step before it, the last step, and `extra` (plan_steps)."""
    last = len(plan) - 1
    steps = {0, 1, 2, last, *extra}
    for boundary in plan.boundaries():
        steps |= {boundary - 1, boundary}
    return sorted(step for step in steps if 0 <= step <= last)


def plan_table(plan: Plan, extra: Iterable[int] = ()) -> tuple[list[str], list[list]]:
    columns = list(flat_values("", plan[0]))
    rows = [[step, *flat_values("", plan[step]).values()] for step in table_steps(plan, extra)]
    return ["step", *columns], rows


def format_table(plan: Plan, extra: Iterable[int] = (), updates_per_batch: int = 1) -> str:
    """The plan's table as text, with the `extra` steps too.

    `updates_per_batch` > 1 (an RL run's rl.updates_per_batch): each row also says which sampled batch its optimizer
    step trains on and which update of it that is; the plan stays indexed by optimizer steps."""
    header, rows = plan_table(plan, extra)
    batches = [] if updates_per_batch == 1 else [
        f"RL: a batch is sampled every {updates_per_batch} optimizer steps; step s trains batch s // "
        f"{updates_per_batch}, update s % {updates_per_batch} (column batch:update)"
    ]  # fmt: skip
    if len(header) == 1:
        return "\n".join(["no override: nothing is sent with optimizer_step", *batches])
    cells = [[str(row[0])] + [f"{v:.6g}" for v in row[1:]] for row in rows]
    if batches:
        header = [header[0], "batch:update", *header[1:]]
        cells = [[c[0], f"{row[0] // updates_per_batch}:{row[0] % updates_per_batch}", *c[1:]] for c, row in zip(cells, rows)]
    table = text_table(header, cells)
    phases = [f"{label}: {describe(s, detail=True)}" for label, s in plan.schedules.items()]
    return "\n".join([table, *phases, *batches])


_LENGTHS = {"warmup_steps": "warmup", "stable_steps": "stable", "decay_steps": "decay", "step_size": "every",
            "milestones": "milestones", "timescale": "timescale"}  # fmt: skip


def describe(schedule: Schedule, detail: bool = False) -> str:
    """A schedule in words, with its lengths in steps as resolved.

    "wsd (warmup 1, decay 4, 1-sqrt)" (the plot's title); `detail` (the table's): "wsd over 20 steps (warmup 1 = 0.05,
    decay 4 = 0.2, 1-sqrt)"."""
    params, given = schedule.params, schedule.fractions
    parts = []
    for name, word in _LENGTHS.items():
        steps = params.get(name)
        if steps is None or (steps == 0 and name not in given):
            continue
        text = f"{word} {steps}" if not isinstance(steps, list) else f"{word} {','.join(map(str, steps))}"
        if detail and name in given:
            fraction = given[name]
            text += f" = {','.join(map(str, fraction)) if isinstance(fraction, list) else fraction}"
        parts.append(text)
    if schedule.kind == "wsd":
        parts.append(params["decay_shape"])
    head = f"{schedule.kind} over {schedule.total_steps} steps" if detail else schedule.kind
    return f"{head} ({', '.join(parts)})" if parts else head


PLAN_FILE = "plan.json"
FORMAT = "tinker_exp plan 1"
SAMPLES = 40
"""plan.json lists the table's steps and this many evenly spaced ones more."""


def file_steps(plan: Plan, extra: Iterable[int] = ()) -> list[int]:
    spaced = np.linspace(0, len(plan) - 1, SAMPLES + 1).round().astype(np.int64).tolist()
    return sorted(set(table_steps(plan, extra)) | set(spaced))


def write_plan_file(plan: Plan, path: Path, extra: Iterable[int] = ()) -> None:
    """Write plan.json: the schedule of every value sent, the phase boundaries and the values at some steps.

    The schedules as the W&B config has them; the values at the table's steps and evenly spaced ones. Kilobytes for any
    number of steps; the plan is rebuilt from it (``read_plan_file``), and the listed values check that the rebuilt plan
    is the run's."""
    head = {
        "format": FORMAT,
        "steps": len(plan),
        "optimizer_name": plan.optimizer,
        "optimizer": {key: list(v) if isinstance(v, tuple) else v for key, v in plan.optimizer_values.items()},
        "boundaries": plan.boundaries(),
    }
    override = override_config(plan, fractions=True)
    lines = ["{", *(f" {json.dumps(key)}: {json.dumps(value)}," for key, value in head.items())]
    lines += [' "override": {', ",\n".join(f"  {json.dumps(key)}: {json.dumps(v)}" for key, v in override.items()), " },"]
    rows = (json.dumps({"step": step, **flat_values("", plan[step])}) for step in file_steps(plan, extra))
    lines += [' "rows": [', ",\n".join(f"  {row}" for row in rows), " ]", "}"]
    path.write_text("\n".join(line for line in lines if line) + "\n", encoding="utf-8")


def _spec(entry: Any) -> Any:
    """An override_config entry as an override value.

    A constant's value, a schedule's mapping (its lengths in steps as resolved; the fractions they were given from are
    only shown)."""
    if isinstance(entry, list):
        return [_spec(item) for item in entry]
    if entry["schedule"] == "constant":
        return entry["value"]
    return {name: value for name, value in entry.items() if name != "fractions"}


def read_plan_file(path: Path) -> Plan:
    """The plan of a run, rebuilt from its plan.json.

    ValueError when the file is not a plan or the rebuilt values differ (beyond 1e-12 relative) from those it lists:
    written by a version whose formulas differ."""
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a plan file ({FORMAT!r})")
    values = {key: tuple(v) if isinstance(v, list) else v for key, v in doc["optimizer"].items()}
    override = {key: _spec(entry) for key, entry in doc["override"].items()}
    plan = plan_for(override, values, doc["steps"], doc.get("optimizer_name", "AdamW"))  # older files: AdamW
    for row in doc["rows"]:
        for name, value in flat_values("", plan[row["step"]]).items():
            if not math.isclose(value, row[name], rel_tol=1e-12):
                raise ValueError(f"{path}: step {row['step']}: {name} is {value!r} here, the run's plan has {row[name]!r}")
    return plan


PLOT_POINTS = 2000


def plot_steps(plan: Plan, points: int = PLOT_POINTS) -> np.ndarray:
    """The steps to draw: every step of a short plan, a sample of a long one that draws the same line.

    Of a long one: the lowest and highest value of every column in each of `points // 2` equal slices, the first and
    last step, and each phase boundary and the step before it: a line through them looks like the line through every
    step, jumps and all."""
    n = len(plan)
    if n <= points:
        return np.arange(n)
    width = -(-n // (points // 2))
    starts = np.arange(0, n, width)
    keep = [starts, np.array([n - 1]), *(np.array([b - 1, b]) for b in plan.boundaries())]
    for column in plan.columns.values():
        if isinstance(column, np.ndarray):
            slices = np.pad(column, (0, len(starts) * width - n), mode="edge").reshape(-1, width)
            keep += [starts + slices.argmin(axis=1), starts + slices.argmax(axis=1)]
    return np.unique(np.minimum(np.concatenate(keep), n - 1))  # the padding repeats the last step


TITLE_WIDTH = 90
"""Characters of the plot's title a line (9 pt on the 7-inch figure)."""


def plot_title(plan: Plan) -> str:
    """The schedule of each key sent, wrapped to the figure's width between keys, never inside one.

    "lr: wsd (warmup 1, decay 4, 1-sqrt), betas[1]: linear"; a constant is "eps: constant"."""
    labels = [label for key in plan.keys for label in (("betas[0]", "betas[1]") if key == "betas" else (key,))]
    named = [f"{label}: {describe(plan.schedules[label]) if label in plan.schedules else 'constant'}" for label in labels]
    lines = [named[0]]
    for item in named[1:]:
        if len(lines[-1]) + len(item) + 2 > TITLE_WIDTH:
            lines[-1] += ","
            lines.append(item)
        else:
            lines[-1] += f", {item}"
    return "\n".join(lines)


@dataclass(frozen=True)
class Part:
    """Steps [first, end) of a run's history, trained in `run_dir` (end None: to that run's last step)."""

    run_dir: Path
    first: int = 0
    end: int | None = None

    def holds(self, step: int) -> bool:
        return step >= self.first and (self.end is None or step < self.end)


def branch_of(run_dir: Path) -> dict[str, Any] | None:
    """A branch's lineage as its plan.json has it ({from, step, checkpoint, trunk_wandb_run_id}).

    None for a run from step 0 (or a run dir without a readable plan.json)."""
    try:
        doc = json.loads((Path(run_dir) / PLAN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    lineage = doc.get("branch") if isinstance(doc, dict) else None
    return lineage if isinstance(lineage, dict) and "from" in lineage and "step" in lineage else None


def history(run_dir: Path) -> list[Part]:
    """Where each step of a run was trained, oldest first.

    A run from step 0 is [itself]; a branch at step N is its trunk's history before N, then itself from N (a branch of a
    branch: recursively). A trunk that is gone (moved, deleted) leaves only the branch's own part, from N, and a
    warning: a picture never fails a run."""
    return _history(Path(run_dir), set())


def _history(run_dir: Path, seen: set[Path]) -> list[Part]:
    lineage = branch_of(run_dir)
    if lineage is None:
        return [Part(run_dir)]
    step, trunk = int(lineage["step"]), Path(lineage["from"])
    seen = seen | {run_dir.resolve()}
    if trunk.resolve() in seen or not (trunk / PLAN_FILE).is_file():
        import warnings

        warnings.warn(f"{run_dir}: its trunk {trunk} (branch.from) is not there; only the branch's own steps are drawn", stacklevel=3)
        return [Part(run_dir, step)]
    before = [Part(p.run_dir, p.first, step if p.end is None else min(p.end, step)) for p in _history(trunk, seen) if p.first < step]
    return [*before, Part(run_dir, step)]


def steps_word(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}..{last}"


TRUNK_COLOR, TRUNK_WIDTH = "0.55", 0.9
"""The trunk's part of a branch's pictures: grey and thin, the branch's own in colour."""
BRANCH_LINE = {"color": "0.15", "linewidth": 1.0, "linestyle": "--"}
"""The vertical line at a branch step, in every panel."""


def plot_plan(plan: Plan, path: Path, parts: list[Part] | None = None) -> Path | None:
    """Draw plan.png: one panel per value sent; None when nothing is sent.

    `parts`: where the run's steps were trained (None: read from the plan.json beside `path`, which a run writes
    first)."""
    fig = draw_plan(plan, parts if parts is not None else history(Path(path).parent))
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def draw_plan(plan: Plan, parts: list[Part]) -> Any:
    """The figure of plan.png (a matplotlib Figure, not saved); None when nothing is sent.

    A branch's (`parts` from `history`) draws its trunk's plan before the branch step (grey, from the trunk's
    plan.json), a dashed line at the step and its own plan from there; each line's label (and the line's gid) says whose
    it is."""
    keys = list(flat_values("", plan[0]))
    if not keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator


    trunks = [(part, _trunk_plan(part.run_dir)) for part in parts[:-1]]
    first = parts[-1].first  # the branch's own part: from its branch step on (0: a run from step 0)
    steps = plot_steps(plan)
    own = steps[steps >= first]
    title = plot_title(plan)
    if first:
        named = f"branch of {display_name(parts[-2].run_dir)} at step {first}" if trunks else f"branch at step {first} (its trunk is not there)"
        title = f"{named}; its own plan from there:\n{title}"
    top = 0.25 + 0.18 * (title.count("\n") + 1)  # inches above the panels: the title's lines
    height = 1.8 * len(keys) + 0.15 + top
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, height), sharex=True, squeeze=False)
    # Fixed margins (inches) rather than tight_layout, which draws the figure once more to measure it.
    fig.subplots_adjust(left=0.16, right=0.97, bottom=0.55 / height, top=1 - top / height, hspace=0.25)
    for ax, key in zip(axes[:, 0], keys):
        for part, trunk_plan in trunks:
            if trunk_plan is not None and key in trunk_plan.columns:
                shown = [s for s in plot_steps(trunk_plan) if part.holds(s)]
                last = (part.end if part.end is not None else len(trunk_plan)) - 1
                label = f"trunk {display_name(part.run_dir)} ({steps_word(part.first, last)})"
                ax.plot(shown, trunk_plan.column(key)[shown], color=TRUNK_COLOR, linewidth=TRUNK_WIDTH, label=label, gid=label)
        label = f"this branch (from step {first})" if first else None
        ax.plot(own, plan.column(key)[own], linewidth=1.2, label=label, gid=label or "plan")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        for boundary in plan.boundaries():
            if boundary >= first:
                ax.axvline(boundary, color="grey", linewidth=0.6, linestyle=":")
        for part in parts:
            if part.first:
                ax.axvline(part.first, gid=f"branch step {part.first}", **BRANCH_LINE)
    if first:
        axes[0, 0].legend(fontsize=7, loc="best")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 2.5 tick on a short plan
    axes[-1, 0].xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{int(x):,}"))  # 1,000,000, not 1e6 offset
    axes[-1, 0].set_xlabel("train/step (0 = the first step)")
    fig.suptitle(title, fontsize=9, y=1 - 0.12 / height, va="top")
    return fig


def _trunk_plan(run_dir: Path) -> Plan | None:
    """A trunk's plan from its plan.json.

    None (with a warning) when it cannot be rebuilt: the branch's own part is still drawn."""
    try:
        return read_plan_file(run_dir / PLAN_FILE)
    except (OSError, ValueError, KeyError, TypeError) as e:
        import warnings

        warnings.warn(f"plan.png: no trunk plan from {run_dir}: {type(e).__name__}: {e}", stacklevel=3)
        return None


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[-1].strip())
        return
    plan = read_plan_file(Path(argv[0]))
    print(f"{len(plan)} steps; sent with optimizer_step:\n{format_table(plan, [int(step) for step in argv[1:]])}")


if __name__ == "__main__":
    main(sys.argv[1:])
