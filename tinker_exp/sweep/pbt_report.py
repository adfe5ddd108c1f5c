"""The end of a PBT sweep: what each member came to, read back from its run dir.

As a table (printed, summary.md, summary.jsonl), population_results.yaml (the best member, its values at the end, the
command that replays it from step 0) and report.png (every member's objective over steps with its exploits, and each
searched key's realized values over steps, per member).

What a member's run dir holds is the member side's (tinker_exp/sweep/pbt.py): population.jsonl (a row per
boundary: its score, rank, the exploit it made or null, the values it went on with), override/realized.yaml and
`realized_values`, metrics.jsonl. Pure Python (matplotlib imported when the picture is drawn)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from tinker_exp.formats import read_json, read_jsonl, text_table
from tinker_exp.sweep.jobs import objective_header, write_summary_files
from tinker_exp.train.objective import ranking_key, was_maximised
from tinker_exp.sweep.report import LINE_WIDTH, BEST_LINE_WIDTH, display_name  # noqa: F401 (display_name: the sweeper's)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

RESULTS_FILE = "population_results.yaml"
REPORT = "report.png"
POPULATION_ROWS = "population.jsonl"  # a member's boundaries, one row each (the member side writes it)
REALIZED = "realized"  # override/realized.yaml: `--config-dir <run dir> +override=realized` replays the member
DEFAULT_METRIC = "val/loss"  # trainer.objective's default: a member that wrote no objective.json is drawn by it


@dataclass
class Member:
    """What one member came to: its start values, its fate, its objective and its exploits."""

    member: int
    start: dict[str, Any]  # the values it started with (searched key -> value)
    status: str  # COMPLETED, or FAILED / CANCELLED / TIMEOUT ... (the launcher's word)
    run_dir: str
    error: str | None = None
    objective: float | None = None  # its final objective (what its job returned); None unless completed
    metric: str = DEFAULT_METRIC  # trainer.objective, as its objective.json names it
    mode: str | None = None  # trainer.objective_mode, as its objective.json names it (None: no file)
    higher_is_better: bool = False  # trainer.objective_mode=max, as its objective.json says
    steps: int = 0  # metrics rows its run dir holds (its own steps, before and after its exploits)
    exploits: list[dict[str, int]] = field(default_factory=list)  # [{"donor": d, "step": s}] in step order
    final: dict[str, Any] = field(default_factory=dict)  # the values of its last step trained
    realized: dict[str, list[Any]] = field(default_factory=dict)  # key -> the value sent at every step, in order
    boundaries: list[dict[str, Any]] = field(default_factory=list)  # population.jsonl's rows

    @property
    def ok(self) -> bool:
        return self.status == "COMPLETED" and self.objective is not None


def read_member(member: int, start: Mapping[str, Any], run_dir: Path, objective: float | None, error: str | None,
                status: str | None = None) -> Member:  # fmt: skip
    """A member as its run dir tells it (whatever it got to before it ended) and its job's final objective."""
    run_dir = Path(run_dir)
    status = status or ("COMPLETED" if error is None else "FAILED")
    found = Member(member, dict(start), status, str(run_dir), error, objective if error is None else None)
    end = read_json(run_dir / "objective.json") or {}
    found.metric = end["metric"] if isinstance(end.get("metric"), str) else DEFAULT_METRIC
    found.mode = end.get("mode")
    found.higher_is_better = was_maximised(end)
    metrics = run_dir / "metrics.jsonl"
    found.steps = len(read_jsonl(metrics)) if metrics.exists() else 0
    rows = run_dir / POPULATION_ROWS
    found.boundaries = read_jsonl(rows) if rows.exists() else []
    found.exploits = [
        {"donor": int(row["exploit"]["member"]), "step": int(row["step"])}
        for row in found.boundaries
        if isinstance(row.get("exploit"), dict)
    ]
    found.realized = realized_of(run_dir)
    last = found.boundaries[-1].get("values") if found.boundaries else None
    found.final = dict(last) if isinstance(last, dict) else dict(start)  # what it went on with from its last boundary
    return found


def realized_of(run_dir: Path) -> dict[str, list[Any]]:
    """What the member's lineage sent at every step, by the sent value's name (lr, weight_decay, beta1, ...).

    The member side's `realized_values`; {} when a donor's run dir is gone or the member trained nothing."""
    from tinker_exp.sweep.pbt import realized_values

    try:
        return {key: list(values) for key, values in realized_values(run_dir).items()}
    except (OSError, ValueError, KeyError):
        return {}


def sent_names(key: str) -> list[str]:
    """The sent values a searched key sets.

    override.lr.value and override.lr.warmup_steps -> lr, +override.weight_decay -> weight_decay, override.betas ->
    beta1, beta2."""
    parts = key.lstrip("+~").split(".")
    name = parts[1] if len(parts) > 1 and parts[0] == "override" else parts[-1]
    return ["beta1", "beta2"] if name == "betas" else [name]


def ranked(members: Sequence[Member]) -> list[Member]:
    """Best final objective (lowest, or highest when maximised) first; members without one after, in member order."""
    return sorted(members, key=lambda m: (not m.ok, ranking_key(m.objective if m.ok else None, m.higher_is_better), m.member))


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _values(values: Mapping[str, Any]) -> str:
    return " ".join(f"{key}={_short(value)}" for key, value in values.items()) or "-"


def donors_text(member: Member) -> str:
    """"2@4, 0@8": the donor of each exploit at its boundary step."""
    return ", ".join(f"{e['donor']}@{e['step']}" for e in member.exploits) or "-"


def table(members: Sequence[Member]) -> str:
    """Ranked by final objective, the best member marked with `*`."""
    header = ["member", objective_header([(m.metric, m.mode) for m in members if m.ok]), "exploits", "donors (member@step)", "start values", "final values", "status", "steps", "run dir"]
    ordered = ranked(members)
    best = ordered[0] if ordered and ordered[0].ok else None
    rows = [
        [f"*{m.member}" if m is best else str(m.member), "-" if m.objective is None else f"{m.objective:.4f}",
         str(len(m.exploits)), donors_text(m), _values(m.start), _values(m.final), m.status, str(m.steps), m.run_dir]
        for m in ordered
    ]  # fmt: skip
    return text_table(header, rows)


def write_summary(sweep_dir: Path, members: Sequence[Member]) -> Path:
    """summary.md (the table, then each failure's error) and summary.jsonl (a row per member, ranked)."""
    failures = [f"- member {m.member} ({m.status}): {m.error}" for m in members if not m.ok and m.error]
    rows = [
        {**{k: v for k, v in asdict(m).items() if k not in ("realized", "boundaries")}, "n_exploits": len(m.exploits)}
        for m in ranked(members)
    ]
    return write_summary_files(sweep_dir, table(members), failures, rows)


def replay_overrides(fixed: Sequence[str], override_in_defaults: bool) -> list[str]:
    """The overrides that replay a member from its realized schedule.

    The sweep's fixed ones without any override selection or override key (realized.yaml holds every value sent), then
    the realized file itself: `+override=` adds the group; a preset that selects an override in its defaults
    (hparams_search=...) is overridden without +, and, since a preset is a sweep with or without -m (its hydra.mode),
    hydra.mode=RUN makes the replay one run."""
    kept = [o for o in fixed if not _is_override(o)]
    selected = any(o.split("=", 1)[0] == "+override" for o in fixed)
    realized = f"override={REALIZED}" if override_in_defaults and not selected else f"+override={REALIZED}"
    preset = any(o.split("=", 1)[0].lstrip("+") == "hparams_search" for o in kept)
    return [realized, *kept, *(["hydra.mode=RUN"] if preset else [])]


def _is_override(override: str) -> bool:
    path = override.split("=", 1)[0].lstrip("+~")
    return path == "override" or path.startswith("override.")


def replay_command(run_dir: str, overrides: Sequence[str]) -> str:
    import shlex

    return " ".join(["python -m tinker_exp --config-dir", shlex.quote(str(run_dir)), *(shlex.quote(o) for o in overrides)])


def results(members: Sequence[Member], fixed: Sequence[str], population: int, interval: int,
            override_in_defaults: bool = False) -> dict[str, Any]:  # fmt: skip
    """What population_results.yaml holds.

    The best member (its final objective, values at the end, run dir and replay command), every member ranked with its
    exploits, and the failed ones with why."""
    ordered = ranked(members)
    best = ordered[0] if ordered and ordered[0].ok else None
    replay = replay_overrides(fixed, override_in_defaults)
    return {
        "name": "pbt",
        "population": population,
        "interval": interval,
        "n_completed": sum(m.ok for m in members),
        "best_member": None if best is None else best.member,
        "best_objective": None if best is None else best.objective,
        "best_values": {} if best is None else dict(best.final),
        "best_run_dir": None if best is None else best.run_dir,
        "replay_overrides": replay,
        "replay_command": None if best is None else replay_command(best.run_dir, replay),
        "members": [
            {"member": m.member, "objective": m.objective, "status": m.status, "exploits": list(m.exploits),
             "start": dict(m.start), "final": dict(m.final), "run_dir": m.run_dir}
            for m in ordered
        ],  # fmt: skip
        "failed": [{"member": m.member, "status": m.status, "error": m.error} for m in members if not m.ok],
    }


def objective_points(member: Member) -> tuple[list[int], list[float]]:
    """(steps trained, objective) at each of the member's evaluations: its own rows, before and after its exploits."""
    metrics = Path(member.run_dir) / "metrics.jsonl"
    rows = read_jsonl(metrics) if metrics.exists() else []
    evaluated = [r for r in rows if "val/loss" in r and _finite(r.get(member.metric))]
    return [int(r["train/step"]) + 1 for r in evaluated], [float(r[member.metric]) for r in evaluated]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def score_at(member: Member, step: int) -> float | None:
    """The score the member posted at boundary `step` (its population.jsonl row), else its evaluation there."""
    for row in member.boundaries:
        if row.get("step") == step and _finite(row.get("score")):
            return float(row["score"])
    steps, values = objective_points(member)
    return values[steps.index(step)] if step in steps else None


def draw_report(members: Sequence[Member], log_scale: Mapping[str, bool], title: str) -> Figure | None:
    """The figure of report.png: the objective panel, then one panel per value the searched keys set.

    The objective panel: every member's evaluations; at each exploit an x on the member's curve at the boundary and a
    thin dotted line from the donor's point there to the member's next evaluation, which continues the donor's weights.
    A value's panel (override.lr.value: the lr sent): each member's lineage's realized value at every step (log scale
    for log dimensions; `log_scale`: searched key, without +, -> a log dimension). Lines carry gids ("member 2",
    "exploit 2<-0@4") so that what is drawn can be read back. None when no member logged an evaluation."""
    drawn = [m for m in members if objective_points(m)[0]]
    if not drawn:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    searched = sorted({key for m in members for key in m.start} | set(log_scale))
    keys = list(dict.fromkeys(name for key in searched for name in sent_names(key)))  # the panels: what was sent
    log_names = {name for key in searched if log_scale.get(key) for name in sent_names(key)}
    by_number = {m.member: m for m in members}
    ordered = ranked(members)
    best = ordered[0] if ordered and ordered[0].ok else None
    fig, axes = plt.subplots(1 + len(keys), 1, figsize=(10, 3.6 + 2.0 * len(keys)), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [2.2] + [1] * len(keys)})  # fmt: skip
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"] if len(members) <= 10 else plt.get_cmap("tab20").colors
    color_of = {m.member: colors[i % len(colors)] for i, m in enumerate(sorted(members, key=lambda m: m.member))}
    ax = axes[0, 0]
    handles = []
    for m in sorted(members, key=lambda m: m.member):
        width = BEST_LINE_WIDTH if m is best else LINE_WIDTH + 0.4
        steps, values = objective_points(m)
        cuts = [e["step"] for e in m.exploits]  # the curve breaks there: what follows continues the donor's weights
        for first, last in zip([-1, *cuts], [*cuts, math.inf]):
            part = [(s, v) for s, v in zip(steps, values) if first < s <= last]
            if part:
                ax.plot(*zip(*part), color=color_of[m.member], linewidth=width, marker="o", markersize=3,
                        zorder=3 if m is best else 2, gid=f"member {m.member}")  # fmt: skip
        for exploit in m.exploits:
            step, donor = exploit["step"], exploit["donor"]
            own, theirs = score_at(m, step), score_at(by_number[donor], step) if donor in by_number else None
            if own is not None:
                ax.plot([step], [own], marker="x", markersize=9, markeredgewidth=2, color=color_of[m.member], linestyle="none",
                        zorder=4, gid=f"exploit {m.member}<-{donor}@{step}")  # fmt: skip
            later = [(s, v) for s, v in zip(steps, values) if s > step]
            if theirs is not None and later:
                ax.plot([step, later[0][0]], [theirs, later[0][1]], color=color_of[m.member], linewidth=0.8, linestyle=":",
                        zorder=1, gid=f"from donor {m.member}<-{donor}@{step}")  # fmt: skip
        objective = "" if m.objective is None else f" -> {m.objective:.4g}"
        exploits = f", {len(m.exploits)} exploit{'s' if len(m.exploits) != 1 else ''}" if m.exploits else ""
        label = f"{'best: ' if m is best else ''}member {m.member}{objective}{exploits}" + ("" if m.ok else f" ({m.status})")
        handles.append(Line2D([], [], color=color_of[m.member], linewidth=4 if m is best else 2, label=label))
    handles.append(Line2D([], [], color="0.3", marker="x", markersize=8, markeredgewidth=2, linestyle="none",
                          label="exploit (the dotted line: from the donor's score)"))  # fmt: skip
    ax.set_ylabel(drawn[0].metric)
    ax.grid(alpha=0.3)
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    for ax, key in zip(axes[1:, 0], keys):
        for m in sorted(members, key=lambda m: m.member):
            values = m.realized.get(key)
            if values and key in log_names:  # a warmup's 0 has no place on a log axis: left out, not a drop to its edge
                values = [v if v > 0 else math.nan for v in values]
            if values:  # the last step's value drawn to the end of that step
                ax.plot(range(len(values) + 1), [*values, values[-1]], drawstyle="steps-post", color=color_of[m.member],
                        linewidth=BEST_LINE_WIDTH if m is best else LINE_WIDTH + 0.4, gid=f"member {m.member}")  # fmt: skip
        if key in log_names:
            ax.set_yscale("log")
        ax.set_ylabel(f"sent {key}", fontsize=8)
        ax.grid(alpha=0.3)
    boundaries = sorted({int(row["step"]) for m in members for row in m.boundaries if "step" in row})
    for ax in axes[:, 0]:
        for step in boundaries:
            ax.axvline(step, color="0.75", linewidth=0.6, zorder=0, gid=f"boundary {step}")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1, 0].set_xlim(left=0)  # from the first step, even when its value is left out (a warmup's 0, log axis)
    axes[-1, 0].set_xlabel("steps done (= train/step + 1; a sent value spans its step, from its train/step to +1; grey: the boundaries)")
    lines = [title]
    if best is not None:
        lines.append(f"best of {sum(m.ok for m in members)} by {best.metric}: member {best.member}, {best.objective:.4g}"
                     f" ({len(best.exploits)} exploits; donors {donors_text(best)})")  # fmt: skip
    fig.suptitle("\n".join(lines), fontsize=10)
    fig.tight_layout()
    return fig


def write_report(members: Sequence[Member], log_scale: Mapping[str, bool], path: Path, title: str) -> Path | None:
    fig = draw_report(members, log_scale, title)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
