"""report.png: every run's losses and the optimizer values that change, drawn together to look at rather than read.

Every run's training and validation loss overlaid (an RL run's train/reward and eval/reward instead, its policy-gradient
loss in a small panel below them, with its KL penalty dotted), and every optimizer value that changes over a run or
differs between runs, one panel each, drawn from what each run applied (applied/KEY) up to where it stopped (a log axis
where the values span more than a decade). One run, a sweep (the best job by its objective drawn thick and named in the
legend), a study (the same, and study.png: the objective against each searched parameter), or any runs together
(`python -m tinker_exp.report`). Each run is labelled by what differs between the runs drawn.

A branch (branch.from) logs only its own steps: its trunk's curves and plan before the branch step are read from
the trunk's run dir and drawn grey and thin (a branch of a branch: each trunk's part), with a dashed line at the
step. Branches of one trunk drawn together (a sweep of branch steps, or `python -m tinker_exp.report TRUNK
BRANCH...`) show the trunk once: up to their last branch step, or whole when it is one of the runs given.

Pure Python (matplotlib, and optuna for a study, imported when a picture is drawn)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tinker_exp.formats import display_name, read_json, read_jsonl
from tinker_exp.train.objective import OBJECTIVE_FILE, came_to, ranking_key, was_maximised

if TYPE_CHECKING:  # imported when a report is drawn: Hydra imports this module with its plugins at every start
    from matplotlib.figure import Figure

    from tinker_exp.optim.plan import Plan
    from tinker_exp.optim.preview import Part

REPORT = "report.png"
STUDY_REPORT = "study.png"  # a study's objective against each searched parameter
# Per-run identity, not a setting: a sweep names each job's W&B run and group after its overrides and sweep dir.
IDENTITY_KEYS = ("logger.run_name", "logger.group")
LINE_WIDTH, BEST_LINE_WIDTH = 1.0, 2.8
REWARD_KEYS = ("train/reward", "eval/reward")  # an RL run's: its main panel, the policy loss below it
POLICY_LOSS, KL_PENALTY = "train/pg_loss", "train/kl_loss"  # an RL run's train/loss is their sum (rl.kl_coef > 0)
LEGEND_BESIDE = 60  # labels up to this many characters: the legend beside the plot, longer ones below it


def title_name(run_dir: Path) -> str:
    """A run's name in a title: where it is below outputs/, after its W&B run name when one was given.

    Not after the W&B name a sweep makes of the job's overrides: the legend has those."""
    from tinker_exp.sweep.jobs import run_name

    where = display_name(run_dir)
    wandb_name = _flat(_read_yaml(run_dir / "config.yaml")).get("logger.run_name")
    overrides = (read_json(run_dir / "job.json") or {}).get("overrides") or []
    if wandb_name in (None, "", "None", where, run_name(overrides, where)):
        return where
    return f"{wandb_name} ({where})"


@dataclass
class RunInfo:
    """What a run dir tells the report: its metrics, plan, objective and what it was started with."""

    dir: Path
    name: str  # the caller's name for it ("job 3", "trial 2"); "" for none
    rows: list[dict[str, Any]]
    plan: Plan | None
    command_line: list[str]  # job.json's command-line overrides, as written
    overrides: dict[str, str]  # the same, key (without +/~) -> value as written
    settings: dict[str, str]  # config.yaml flattened, and Hydra's group choices (.hydra/hydra.yaml)
    objective: dict[str, Any] | None  # objective.json: metric, mode, value (a finite value, else None)
    schedules: str  # the plan's schedules in words ("lr: cosine"); "" when it sends nothing
    parts: list[Part]  # where its steps were trained (preview.history): [itself], or a branch's trunks then itself
    label: str = field(default="")
    completed: bool = True  # it wrote objective.json: it ran to its end, stopped early by its own rule, or was pruned

    @property
    def first(self) -> int:
        """The first step the run trained itself (its branch step; 0 for a run from step 0)."""
        return self.parts[-1].first

    @property
    def ended_early(self) -> str:
        """What its label adds when it did not complete: " (stopped after N of M steps)", else "".

        A run that logged steps and ended before its last without completing (killed, cut off by its sweep's stop,
        failed): its curves end short, and its label says why."""
        steps = self.settings.get("trainer.steps", "")
        if self.completed or not self.rows or not steps.isdigit():
            return ""
        done = int(_step(self.rows[-1])) + 1
        return f" (stopped after {done} of {steps} steps)" if done < int(steps) else ""


def read_run(run_dir: Path, name: str = "", completed: bool | None = None) -> RunInfo:
    """What the report draws of a run dir; `completed` None: whether the run completed, as its objective.json says."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    job = read_json(run_dir / "job.json") or {}
    overrides = {}
    for override in job.get("overrides") or []:
        key, _, value = str(override).lstrip("+~").partition("=")
        overrides[key] = value
    settings = _flat(_read_yaml(run_dir / "config.yaml"))
    choices = (_read_yaml(run_dir / ".hydra" / "hydra.yaml") or {}).get("hydra", {}).get("runtime", {}).get("choices", {})
    # A group left out (hparams_search: null) reads as no value, as a +group never given does.
    settings.update({k: str(v) for k, v in (choices or {}).items() if v is not None and not k.startswith("hydra/")})
    objective = read_json(run_dir / "objective.json")
    if not (isinstance(objective, dict) and _finite(objective.get("value"))):
        objective = None
    command_line = [str(override) for override in job.get("overrides") or []]
    from tinker_exp.optim.preview import history

    return RunInfo(run_dir, name, read_jsonl(metrics) if metrics.exists() else [], _plan(run_dir), command_line, overrides,
                   settings, objective, _schedules(run_dir), history(run_dir), completed=(run_dir / OBJECTIVE_FILE).exists() if completed is None else completed)  # fmt: skip


def _read_yaml(path: Path) -> Any:
    if not path.exists():
        return None
    import yaml

    try:
        # libyaml's parser where PyYAML has it: the same values, and a run's .hydra/hydra.yaml in a tenth of the time
        return yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, yaml.YAMLError):
        return None


def _flat(tree: Any, prefix: str = "") -> dict[str, str]:
    """Nested mappings as dotted keys -> the value as text (lists whole)."""
    if not isinstance(tree, dict):
        return {prefix: str(tree)} if prefix else {}
    flat: dict[str, str] = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _schedules(run_dir: Path) -> str:
    """plan.json's override in words, each schedule's parameters as given.

    Only those given (plan.json also holds those left at their defaults: wsd's stable_steps None, num_cycles 0.5): "lr:
    cosine (warmup_steps 2, min_ratio 0.1); beta2: 0.95"."""
    from tinker_exp.optim.schedules import schedule_defaults

    override = (read_json(run_dir / "plan.json") or {}).get("override") or {}

    def words(entry: Any) -> str:
        if isinstance(entry, list):  # one entry per param group
            return "[" + ", ".join(words(item) for item in entry) + "]"
        if not isinstance(entry, dict):
            return str(entry)
        if entry.get("schedule") == "constant":
            return _short(entry.get("value"))
        defaults = schedule_defaults(str(entry.get("schedule")))  # a value left at its default says nothing
        shown = [f"{key} {_short(value)}" for key, value in entry.items()
                 if key not in ("schedule", "total_steps", "fractions") and (key not in defaults or value != defaults[key])]  # fmt: skip
        return f"{entry.get('schedule')} ({', '.join(shown)})" if shown else str(entry.get("schedule"))

    return "; ".join(f"{key}: {words(entry)}" for key, entry in override.items())


def _short(value: Any) -> str:
    """A value for a legend: floats (also as written on a command line) to 3 significant digits."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return f"{number:.3g}" if ("." in value or "e" in value.lower()) and math.isfinite(number) else value
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def label_runs(runs: Sequence[RunInfo]) -> None:
    """Each run's label: what differs between the runs.

    The command-line overrides first (a run without one shows its config's value); where they leave runs alike, every
    config key that differs; where even that does, the run dir. One run: its overrides, else its schedules. A run that
    did not complete says where it stopped (`ended_early`)."""
    if len(runs) == 1:
        run = runs[0]
        shown = [f"{key}={_short(value)}" if sep else key
                 for key, sep, value in (override.partition("=") for override in run.command_line)]  # fmt: skip
        if len(run.parts) > 1:  # a branch: its trunk as the trunk's legend entry names it, not a whole path
            shown = [f"branch.from={display_name(run.parts[-2].run_dir)}" if item.startswith("branch.from=") else item
                     for item in shown]  # fmt: skip
        run.label = (" ".join(shown) or run.schedules or "defaults, no override") + run.ended_early
        return

    def value(run: RunInfo, key: str) -> str:
        return run.overrides.get(key, run.settings.get(key, "-"))

    def differing(keys: Sequence[str]) -> list[str]:
        return [key for key in keys if key not in IDENTITY_KEYS and len({_short(value(run, key)) for run in runs}) > 1]

    def label_by(run: RunInfo, keys: Sequence[str]) -> str:
        # A key the run has no value for, or left unset (null in its config: +override not given), is left out.
        parts = [f"{key}={_short(value(run, key))}" for key in keys
                 if value(run, key) != "-" and (key in run.overrides or value(run, key) != "None")]  # fmt: skip
        return " ".join(parts) or ("defaults" if keys else "")

    def labels_by(keys: Sequence[str]) -> list[str]:
        return [label_by(run, keys) for run in runs]

    override_keys = list(dict.fromkeys(key for run in runs for key in run.overrides))
    keys = differing(override_keys)
    labels = labels_by(keys)
    if len(set(labels)) < len(runs):
        setting_keys = sorted({key for run in runs for key in run.settings} - set(override_keys))
        keys += differing(setting_keys)
        labels = labels_by(keys)
    if len(set(labels)) < len(runs):
        labels = [f"{label} {display_name(run.dir)}".strip() for label, run in zip(labels, runs)]
    for run, label in zip(runs, labels):
        run.label = ": ".join(part for part in (run.name, label) if part) + run.ended_early


def by_branch_step(runs: Sequence[RunInfo]) -> list[list[RunInfo]]:
    """Branches of more than one branch step (their budget), grouped by it, earliest first; any other runs: one group.

    Each group's best is its own (decays of one budget compared, not budgets)."""
    keys = {(run.parts[-2].run_dir.resolve(), run.first) if len(run.parts) > 1 else None for run in runs}
    if None in keys or len(keys) < 2:
        return [list(runs)]
    return [[run for run in runs if (run.parts[-2].run_dir.resolve(), run.first) == key]
            for key in sorted(keys, key=lambda key: (str(key[0]), key[1]))]  # fmt: skip


def best_run(runs: Sequence[RunInfo]) -> RunInfo | None:
    """The run with the best objective (the lowest; the highest where it was maximised), when the runs can be ranked.

    They can when at least two runs have one and all of them judge by the same metric and mode (runs of sweeps with
    different objectives are not ranked)."""
    judged = [run for run in runs if run.objective is not None]
    if len(judged) < 2 or len({(run.objective["metric"], run.objective["mode"]) for run in judged}) > 1:
        return None
    return min(judged, key=lambda run: ranking_key(run.objective["value"], was_maximised(run.objective)))


def _step(row: dict) -> Any:
    return row.get("train/step", row.get("step"))


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(_step(row), row[key]) for row in rows if key in row]
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


def _plan_series(plan: Plan | None, key: str, part: Part | None = None) -> tuple[Any, Any]:
    """The plan's `key` at the steps to draw; `part`: only the steps it holds (a branch's own, a trunk's before)."""
    from tinker_exp.optim.preview import plot_steps

    if plan is None or key not in plan.columns:
        return [], []
    steps = plot_steps(plan)  # a long plan decimated, its jumps and phase boundaries kept
    if part is not None:
        steps = steps[(steps >= part.first) & (steps < (part.end if part.end is not None else len(plan)))]
    return steps, plan.column(key)[steps]


def _varying_keys(runs: Sequence[RunInfo]) -> list[str]:
    """The optimizer values worth a panel: those that change over a run's steps or differ between runs.

    Those the runs' plans change over their steps, and those whose applied value (metrics' applied/KEY, every float of
    the param group, sent or not) differs between steps or runs."""
    keys = {
        name
        for run in runs
        if run.plan is not None
        for name, column in run.plan.columns.items()
        if not isinstance(column, float) and column.min() != column.max()
    }
    applied: dict[str, set[float]] = {}
    for run in runs:
        logged = False
        for row in run.rows:
            for key, value in row.items():
                if key.startswith("applied/") and _finite(value):
                    applied.setdefault(key.removeprefix("applied/"), set()).add(float(value))
                    logged = True
        if not logged:  # a run of an earlier version: its optimizer's constants
            for key, value in _constants(run).items():
                applied.setdefault(key, set()).add(value)
    return sorted(keys | {key for key, values in applied.items() if len(values) > 1})


def _constants(run: RunInfo) -> dict[str, float]:
    """The values its plan keeps constant: a constant column, else the optimizer's own (nothing sent for it)."""
    if run.plan is None:
        return {}
    from tinker_exp.optim.convert import flat_values

    values = {k: float(v) for k, v in flat_values("", run.plan.optimizer_values).items() if _finite(v)}
    values.update({k: c for k, c in run.plan.columns.items() if isinstance(c, float)})
    return {k: v for k, v in values.items() if k not in run.plan.columns or isinstance(run.plan.columns[k], float)}


def _sent_series(run: RunInfo, rows: Sequence[dict[str, Any]], key: str, part: Part) -> tuple[Any, Any]:
    """The value the optimizer applied at each step the run logged (metrics' applied/KEY).

    A run stopped early (pruned, killed) ends where it stopped. Rows without it (a run of an earlier version): its
    plan's, over `part` (a value the plan keeps constant, over the steps it logged)."""
    steps, values = _series(list(rows), f"applied/{key}")
    if steps:
        return steps, values
    logged = [_step(row) for row in rows]
    constant = _constants(run).get(key)
    if constant is not None:
        return logged, [constant] * len(logged)
    steps, values = _plan_series(run.plan, key, part)
    if logged and len(steps):  # the plan only as far as the run got
        kept = steps <= max(logged)
        return steps[kept], values[kept]
    return steps, values


def _log_axis_over_a_decade(ax: Any) -> None:
    """A log y axis when the positive values drawn span more than a decade (learning rates of a sweep); symlog with a 0.

    With a 0 among them (a warmup from 0), symlog: linear from 0 up to the least positive value (as tall as a decade),
    logarithmic above it, labelled at 0 and at the decades from that value up (a decade below it would sit on 0's
    label)."""
    from matplotlib.ticker import FixedLocator

    values = [float(v) for line in ax.get_lines() for v in line.get_ydata() if _finite(float(v))]
    positive = [v for v in values if v > 0]
    if not positive or min(values) < 0 or max(positive) / min(positive) <= 10:
        return
    if min(values) == 0:
        least = min(positive)
        ax.set_yscale("symlog", linthresh=least, linscale=1.0)
        decades = range(math.ceil(math.log10(least)), math.ceil(math.log10(max(positive))) + 1)
        every = math.ceil(len(decades) / 6)  # at most 6 decades labelled in a panel's height
        ax.yaxis.set_major_locator(FixedLocator([0.0, *(10.0**k for k in decades[::every])]))
    else:
        ax.set_yscale("log")


@dataclass
class Trunk:
    """A trunk's part of the report: drawn once, grey and thin, however many branches of it are drawn."""

    run: RunInfo
    part: Part  # the steps drawn: up to the last branch step drawn, or to the end (a trunk given as a run)

    @property
    def label(self) -> str:
        from tinker_exp.optim.preview import steps_word

        logged = [_step(row) for row in self.run.rows if self.part.holds(_step(row))]
        last = self.part.end - 1 if self.part.end is not None else max(logged, default=self.part.first)
        name = display_name(self.run.dir)
        said = "" if "trunk" in name.rsplit("/", 1)[-1].lower() else "trunk "  # a dir named trunk: not "trunk trunk"
        return f"{said}{name} ({steps_word(self.part.first, last)})"

    def rows(self) -> list[dict[str, Any]]:
        return [row for row in self.run.rows if self.part.holds(_step(row))]


def trunks_of(runs: Sequence[RunInfo]) -> tuple[list[Trunk], list[RunInfo]]:
    """The trunks of the runs that are branches (each once, oldest first), and the runs drawn in colour.

    A run that is itself a trunk of another run drawn is drawn as a trunk, whole."""
    from tinker_exp.optim.preview import Part

    given = {run.dir.resolve(): run for run in runs}
    spans: dict[Path, Part] = {}

    def merge(part: Part) -> None:
        key = part.run_dir.resolve()
        seen = spans.get(key)
        if seen is not None:
            end = None if None in (seen.end, part.end) else max(seen.end, part.end)  # type: ignore[type-var]
            part = Part(seen.run_dir, min(seen.first, part.first), end)
        spans[key] = part

    for run in runs:
        for part in run.parts[:-1]:
            merge(part)
    drawn = [run for run in runs if run.dir.resolve() not in spans]
    if not drawn:  # runs that are each other's trunks (a copied run dir): draw them all as runs
        return [], list(runs)
    for key in spans.keys() & given.keys():
        merge(Part(given[key].dir, given[key].first, None))
    trunks = [Trunk(given.get(key) or read_run(part.run_dir), part) for key, part in spans.items()]
    return sorted(trunks, key=lambda trunk: trunk.part.first), drawn


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def warm_up() -> None:
    """What drawing a report first costs, paid now (matplotlib imported, a first figure drawn).

    A sweep calls it in a thread while its trials train, so that its summary's pictures at its end do not wait for it; a
    pool, before its first run."""
    plt = _pyplot()
    from matplotlib.lines import Line2D  # noqa: F401  (draw_report's)
    from matplotlib.ticker import MaxNLocator  # noqa: F401

    fig = plt.figure(figsize=(1, 1))
    fig.text(0.5, 0.5, "0")
    fig.canvas.draw()  # the font cache and the Agg canvas
    plt.close(fig)


def draw_report(runs: Sequence[RunInfo], title: str) -> Figure | None:
    """The figure (not saved): the loss or reward panels, then one panel per plan key that changes; None without steps.

    The loss panel, or when a run logged train/reward or eval/reward (RL) the reward panel and the policy loss's below
    it, then one panel per plan key that changes. Each run's loss lines carry its label as their gid, and the legend one
    entry per run, so what is drawn can be read back. None when no run logged a step."""
    trunks, runs = trunks_of(runs)
    label_runs(runs)  # over every run: a failed job's overrides still tell the others apart
    silent = [run for run in runs if not run.rows]
    runs = [run for run in runs if run.rows]
    if not runs:
        return None
    groups = by_branch_step(runs)
    bests = [b for group in groups if (b := best_run(group)) is not None]
    runs = [run for group in groups for run in group]  # a group's runs together in the legend
    varying = _varying_keys([*runs, *(trunk.run for trunk in trunks)])
    branch_steps = sorted({part.first for run in runs for part in run.parts if part.first})  # also a gone trunk's
    rewarded = any(key in row for run in [*runs, *(t.run for t in trunks)] for row in run.rows for key in REWARD_KEYS)
    plt = _pyplot()
    from matplotlib.lines import Line2D

    from tinker_exp.optim.preview import BRANCH_LINE, TRUNK_COLOR, TRUNK_WIDTH  # as plan.png draws a branch

    # The legend never over several runs' lines: beside the plot, or below it when the labels are long.
    widest = max([len(run.label) for run in runs] + [len(trunk.label) for trunk in trunks]) + 12
    below = widest > LEGEND_BESIDE
    beside = len(runs) > 1 and not below  # one run with a short label: inside its loss panel
    legend_width = 0.075 * widest if beside else 0
    fig, axes = plt.subplots(1 + rewarded + len(varying), 1, figsize=(8 + legend_width, 3.4 + 1.8 * (rewarded + len(varying))),
                             sharex=True, squeeze=False, gridspec_kw={"height_ratios": [2.2] + [1] * (rewarded + len(varying))})  # fmt: skip
    # An RL run is read by its reward: the reward is the main panel, its policy-gradient loss a small one below it.
    reward_ax = axes[0, 0] if rewarded else None
    loss_ax = axes[1, 0] if rewarded else axes[0, 0]
    main_ax = axes[0, 0]
    plan_axes = axes[1 + rewarded :, 0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"] if len(runs) <= 10 else plt.get_cmap("tab20").colors
    kinds = ("train/reward", "eval/reward") if rewarded else ("train", "val")
    handles = [Line2D([], [], color="0.3", linewidth=1.0, label=kinds[0]),
               Line2D([], [], color="0.3", linewidth=1.6, linestyle="--", marker="o", markersize=3, label=kinds[1])]  # fmt: skip
    for trunk in trunks:
        rows = trunk.rows()
        _draw_loss(loss_ax, rows, rewarded, color=TRUNK_COLOR, linewidth=TRUNK_WIDTH, zorder=1, gid=trunk.label)
        steps, values = _series(rows, "val/loss")
        if steps:
            loss_ax.plot(steps, values, color=TRUNK_COLOR, linewidth=TRUNK_WIDTH + 0.4, linestyle="--", marker="o",
                         markersize=2.5, zorder=1, gid=trunk.label)  # fmt: skip
        if reward_ax is not None:
            _draw_reward(reward_ax, rows, color=TRUNK_COLOR, linewidth=TRUNK_WIDTH, zorder=1, gid=trunk.label)
        for ax, key in zip(plan_axes, varying):
            ax.plot(*_sent_series(trunk.run, rows, key, trunk.part), color=TRUNK_COLOR, linewidth=TRUNK_WIDTH, zorder=1,
                    gid=trunk.label)  # fmt: skip
        handles.append(Line2D([], [], color=TRUNK_COLOR, linewidth=TRUNK_WIDTH + 0.6, label=trunk.label))
    for i, run in enumerate(runs):
        color, is_best = colors[i % len(colors)], any(run is b for b in bests)
        width = BEST_LINE_WIDTH if is_best else LINE_WIDTH
        alpha = 1.0 if is_best or not bests else 0.6
        z = 3 if is_best else 2
        _draw_loss(loss_ax, run.rows, rewarded, color=color, linewidth=width, alpha=alpha, zorder=z, gid=run.label)
        steps, values = _series(run.rows, "val/loss")
        if steps:
            loss_ax.plot(steps, values, color=color, linewidth=width + 0.6, linestyle="--", marker="o",
                         markersize=5 if is_best else 3, alpha=alpha, zorder=z, gid=run.label)  # fmt: skip
        if reward_ax is not None:
            _draw_reward(reward_ax, run.rows, color=color, linewidth=width, alpha=alpha, zorder=z, gid=run.label)
        for ax, key in zip(plan_axes, varying):  # a branch's from its branch step: the trunk's is grey
            ax.plot(*_sent_series(run, run.rows, key, run.parts[-1]), color=color, linewidth=width + 0.2, alpha=alpha,
                    zorder=z, gid=run.label)  # fmt: skip
        label = run.label
        if run.objective is not None and len(runs) > 1:
            label += f" -> {run.objective['value']:.4g}"
        if is_best:
            label = f"best: {label}" if len(groups) == 1 else f"best at step {run.first}: {label}"
        handles.append(Line2D([], [], color=color, linewidth=4 if is_best else 2, label=label))
    penalised = rewarded and any(KL_PENALTY in row for run in [*runs, *(t.run for t in trunks)] for row in run.rows)
    if penalised:
        handles.insert(2, Line2D([], [], color="0.3", linewidth=1.0, linestyle=":", label="KL penalty (in the loss)"))
    loss_ax.set_ylabel(("policy loss, KL penalty" if penalised else "policy loss") if rewarded else "loss")
    loss_ax.grid(alpha=0.3)
    if reward_ax is not None:
        reward_ax.set_ylabel("reward")
        reward_ax.grid(alpha=0.3)
    if beside:
        main_ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    elif below:
        fig.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(0.0, 0.0), frameon=False)
    else:
        main_ax.legend(handles=handles, fontsize=8, loc="best")
    for ax, key in zip(plan_axes, varying):
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        _log_axis_over_a_decade(ax)
    for ax in axes[:, 0]:
        for step in branch_steps:
            ax.axvline(step, gid=f"branch step {step}", zorder=0, **BRANCH_LINE)
    from matplotlib.ticker import MaxNLocator

    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 0.5 tick on a short run
    # Two step counts meet here: rows are at train/step (from 0); a branch step is steps done (its line: its first own step).
    branch_words = "; dashed: branch step N, after N steps done, at the branch's first train/step" if branch_steps else ""
    axes[-1, 0].set_xlabel(f"train/step (0 = the first step{branch_words})")
    lines = _title_lines(title, runs, bests, len(groups) > 1, silent)
    _fitted_title(fig, lines, 110 + int(12 * legend_width))
    fig.tight_layout()
    return fig


def _draw_loss(ax: Any, rows: list[dict[str, Any]], rewarded: bool, **style: Any) -> None:
    """A run's train/loss; an RL run's policy loss and, with rl.kl_coef, its KL penalty.

    The policy loss is train/pg_loss: train/loss less the KL penalty; the KL penalty is train/kl_loss, dotted (the same
    units, a token sum)."""
    if not rewarded:
        ax.plot(*_series(rows, "train/loss"), **style)
        return
    ax.plot(*_series(rows, POLICY_LOSS if any(POLICY_LOSS in row for row in rows) else "train/loss"), **style)
    steps, values = _series(rows, KL_PENALTY)
    if steps:
        ax.plot(steps, values, **style, linestyle=":")


def _draw_reward(ax: Any, rows: list[dict[str, Any]], **style: Any) -> None:
    """One run's train/reward (solid) and eval/reward (dashed, a dot per evaluation), as its losses are drawn."""
    ax.plot(*_series(rows, "train/reward"), **style)
    steps, values = _series(rows, "eval/reward")
    if steps:
        ax.plot(steps, values, **(style | {"linewidth": style["linewidth"] + 0.6}), linestyle="--", marker="o", markersize=3)


def _title_lines(title: str, runs: Sequence[RunInfo], bests: Sequence[RunInfo], by_step: bool, silent: Sequence[RunInfo]) -> list[str]:
    """The title's lines: where the branches drawn came from, the best run or the schedules, then the runs not drawn.

    The best run and what judged it when several runs are drawn; the schedules when one is."""
    from tinker_exp.sweep.jobs import branches_line

    lines = [title]
    origin = branches_line([(display_name(run.parts[-2].run_dir), run.first) for run in runs if len(run.parts) > 1 and run.first])
    if origin:
        lines.append(origin)
    if by_step and bests:  # branches of several branch steps: each budget's best, not one over the budgets
        metric, mode = bests[0].objective["metric"], bests[0].objective["mode"]
        each = "; ".join(f"step {b.first}: {b.name or b.label}, {b.objective['value']:.4g}" for b in bests)
        lines.append(f"best of each branch step by {metric} ({mode}): {each}")
    elif bests:
        best = bests[0]
        judged = sum(run.objective is not None for run in runs)
        metric, mode, value = best.objective["metric"], best.objective["mode"], best.objective["value"]
        lines.append(f"best of {judged} by {metric} ({mode}): {best.name or best.label}, {value:.4g}")
    elif len(runs) == 1 and runs[0].schedules and runs[0].label != runs[0].schedules:
        lines.append(runs[0].schedules)  # the legend has the overrides; the schedules they made, here
    if len(runs) == 1 and "train/reward" in runs[0].rows[-1]:  # an RL run: what it came to, as its last line says
        lines.append(came_to(runs[0].rows))
    if silent:
        lines.append("not drawn, no step logged: " + ", ".join(run.name or run.label for run in silent))
    return lines


def _fitted_title(fig: Any, lines: Sequence[str], width: int) -> None:
    """The title, its lines wrapped at `width` characters, or fewer where a line drawn is wider than the figure.

    Fewer for long names or wide letters: no line runs past the picture's edges."""
    text = fig.suptitle("\n".join(_wrap(line, width) for line in lines), fontsize=10)
    renderer = fig.canvas.get_renderer()
    while width > 40 and text.get_window_extent(renderer).width > 0.98 * fig.bbox.width:
        width -= 6
        text.set_text("\n".join(_wrap(line, width) for line in lines))


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width)) or text


def write_report(runs: Sequence[tuple[str, Path]], path: Path, title: str, completed: bool | None = None) -> Path | None:
    """report.png of `runs` ((name, run dir); the name, "job 3" or "" for none, leads the run's label) at `path`.

    None when no run logged a step. `completed`: True from a run that has just ended by its own rule, before its
    objective.json is written."""
    fig = draw_report([read_run(run_dir, name, completed) for name, run_dir in runs], title)
    if fig is None:
        return None
    fig.savefig(path, dpi=100, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def draw_study(study: Any, title: str) -> Figure | None:
    """The objective against each searched parameter, the best trial ringed in red; None when no trial completed.

    Optuna's slice plot: one panel per parameter, a point per completed trial, coloured by trial number."""
    import optuna
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        return None
    import matplotlib
    from matplotlib.lines import Line2D

    _pyplot()
    # Optuna sets its own style (ggplot) for good: the rc context keeps it to this figure, not the next report's.
    with warnings.catch_warnings(), matplotlib.rc_context():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # "experimental": not in the log
        # One distinct value on an axis (one trial, or a choice that every trial drew alike): Optuna's x limits are
        # equal and matplotlib widens them, warning; one trial's axes are set to the searched range below.
        warnings.filterwarnings("ignore", message="Attempting to set identical low and high xlims", category=UserWarning)
        axes = optuna.visualization.matplotlib.plot_slice(study)
    axes_list = list(getattr(axes, "flat", [axes]))
    if len(complete) == 1:
        _one_trial(axes_list, complete[0])
    best = study.best_trial
    # Pruned trials marked, not dropped: each at the last value it reported (where its pruner stopped it).
    pruned = [t for t in study.get_trials(deepcopy=False, states=(TrialState.PRUNED,)) if _finite(t.value)]
    ringed, crossed = [], False
    for ax in axes_list:
        ax.set_title("")  # one parameter: Optuna's "Slice Plot" over our title
        name = ax.get_xlabel()
        # A choice (numbers too) sits at its tick on a categorical axis, as Optuna places it; a range at its value.
        categorical = isinstance(best.distributions.get(name), optuna.distributions.CategoricalDistribution)
        if categorical:  # a choice only pruned trials drew has no tick of Optuna's: one is added after the others
            _add_choices(ax, [t.params[name] for t in pruned if name in t.params])
        at = _place(ax, best.params.get(name), categorical)
        if at is not None:
            ax.scatter([at], [best.value], s=160, facecolors="none", edgecolors="red", linewidths=2, zorder=5,
                       label=f"best: trial {best.number}")  # fmt: skip
            ringed.append(ax)
        places = [(_place(ax, t.params[name], categorical), t.value) for t in pruned if name in t.params]
        places = [(x, y) for x, y in places if x is not None]
        if places:
            ax.scatter(*zip(*places), marker="x", s=45, color="0.35", linewidths=1.6, zorder=4, gid="pruned")
            crossed = True
            if not categorical:  # Optuna fixed the limits to the completed trials': widened to hold the pruned too
                _widen(ax, [x for x, _ in places])
        if ax.get_xscale() == "log":
            _readable_log_ticks(ax)
    ring = Line2D([], [], linestyle="none", marker="o", markersize=11, markerfacecolor="none", markeredgecolor="red",
                  markeredgewidth=2, label=f"best: trial {best.number}")  # fmt: skip
    cross = Line2D([], [], linestyle="none", marker="x", markersize=7, color="0.35", markeredgewidth=1.6,
                   label=f"pruned ({len(pruned)}): its last reported value")  # fmt: skip
    shown = [ring] * bool(ringed) + [cross] * crossed
    if shown:  # our legend, not Optuna's own (an empty "Infeasible Trial")
        (ringed or axes_list)[0].legend(handles=shown, loc="best", fontsize=8)
    fig = axes_list[0].figure
    fig.set_size_inches(4.2 * len(axes_list) + 1.5, 4.5)  # Optuna's default crowds a log axis' tick labels
    counted = f"{len(complete)} completed" + (f", {len(pruned)} pruned (x)" if pruned else "")
    better = "higher" if study.direction == optuna.study.StudyDirection.MAXIMIZE else "lower"  # eval/reward: higher
    fig.suptitle(f"{title}\nobjective ({better} is better) against each searched parameter ({counted}); best: trial "
                 f"{best.number}, {best.value:.4g}", fontsize=10)  # fmt: skip
    return fig


def _one_trial(axes: Sequence[Any], trial: Any) -> None:
    """A study of one completed trial: no colour bar of trial numbers, each numeric axis over its searched range.

    No colour bar: Optuna's spans a made-up 0.9-1.1 around the one trial. Each numeric axis is over the parameter's
    searched range, where the point sits in it."""
    import optuna

    for ax in axes[0].figure.axes:
        if ax.get_label() == "<colorbar>":
            ax.remove()
    for ax in axes:
        searched = trial.distributions.get(ax.get_xlabel())
        if isinstance(searched, (optuna.distributions.FloatDistribution, optuna.distributions.IntDistribution)) and searched.high > searched.low:
            ax.set_xlim(searched.low, searched.high)
            _widen(ax, [searched.low, searched.high])


def _widen(ax: Any, xs: Sequence[float]) -> None:
    low, high = ax.get_xlim()
    low, high = min(low, *xs), max(high, *xs)
    if ax.get_xscale() == "log" and low > 0:
        pad = (high / low) ** 0.05
        ax.set_xlim(low / pad, high * pad)
    else:
        pad = 0.05 * (high - low)
        ax.set_xlim(low - pad, high + pad)


def _place(ax: Any, value: Any, categorical: bool) -> float | None:
    """Where a parameter's value sits on its axis; None for a choice no completed trial drew.

    A number of a range at itself, a choice at its tick (Optuna's labels); None for a choice no completed trial drew
    (Optuna gave it no tick)."""
    if not categorical:
        return float(value) if _finite(value) else None
    for tick, text in zip(ax.get_xticks(), ax.get_xticklabels()):
        if text.get_text() in (str(value), repr(value)):
            return float(tick)
    return None


def _add_choices(ax: Any, values: Sequence[Any]) -> None:
    """Ticks for the choices among `values` that a categorical axis lacks (Optuna labels a choice by its repr)."""
    ticks, labels = list(ax.get_xticks()), [text.get_text() for text in ax.get_xticklabels()]
    missing = list(dict.fromkeys(repr(v) for v in values if repr(v) not in labels and str(v) not in labels))
    if not missing:
        return
    ticks += [float(len(ticks) + i) for i in range(len(missing))]
    ax.set_xticks(ticks, labels + missing)
    ax.set_xlim(-0.5, len(ticks) - 0.5)


def _readable_log_ticks(ax: Any) -> None:
    """A log axis labelled at a few round values (1e-04, 3e-04, ...), never at every minor tick (they overlap)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    low, high = ax.get_xlim()
    decades = math.log10(high / low) if low > 0 and high > low else 0
    subs = (1.0,) if decades > 3 else (1.0, 3.0) if decades > 1 else (1.0, 2.0, 5.0)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0e}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def write_study_report(study: Any, path: Path, title: str) -> Path | None:
    fig = draw_study(study, title)
    if fig is None:
        return None
    fig.savefig(path, dpi=100, bbox_inches="tight")
    _pyplot().close(fig)
    return path
