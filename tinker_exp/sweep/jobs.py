"""Sweeps: who a job is (Slurm ids, W&B group and name) and what each job of a sweep came to.

Pure Python (stdlib only): the job side writes `job.json` into its run dir; the sweep driver (our Hydra
launchers in hydra_plugins/tinker_exp_plugins) reads run dirs back into one summary table.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from tinker_exp.formats import read_jsonl, text_table
from tinker_exp.sweep.slurm import Settling
from tinker_exp.train.objective import ranking_key, read_run_end, was_maximised

# What Slurm tells a job about itself (sbatch / srun set these in the job's environment).
SLURM_VARIABLES = {
    "job_id": "SLURM_JOB_ID",
    "array_job_id": "SLURM_ARRAY_JOB_ID",
    "array_task_id": "SLURM_ARRAY_TASK_ID",
    "job_name": "SLURM_JOB_NAME",
    "partition": "SLURM_JOB_PARTITION",
    "nodelist": "SLURM_JOB_NODELIST",
    "num_nodes": "SLURM_JOB_NUM_NODES",
    "cpus_on_node": "SLURM_CPUS_ON_NODE",
    "restart_count": "SLURM_RESTART_COUNT",  # set once the job was requeued (time limit, preemption)
}
JOB_FILE = "job.json"
SUMMARY_MD = "summary.md"
SUMMARY_JSONL = "summary.jsonl"


def slurm_job(environ: Mapping[str, str] = os.environ) -> dict[str, str] | None:
    """The Slurm job this process runs in, or None outside Slurm."""
    if "SLURM_JOB_ID" not in environ:
        return None
    return {key: environ[var] for key, var in SLURM_VARIABLES.items() if var in environ}


def job_info(num: int | None, overrides: Sequence[str], environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    return {"num": num, "overrides": list(overrides), "host": socket.gethostname(), "slurm": slurm_job(environ)}


def write_job_info(run_dir: Path, info: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / JOB_FILE).write_text(json.dumps(info, indent=1) + "\n")


def sweep_group(sweep_dir: str, cwd: Path | None = None) -> str:
    """One W&B group per sweep: the sweep dir below outputs/sweeps (its date/time), else its own name."""
    path = Path(sweep_dir)
    root = (cwd or Path.cwd()) / "outputs" / "sweeps"
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return path.name


def run_name(task_overrides: Sequence[str], fallback: str) -> str:
    """A sweep job is named by its overrides (what tells it apart on a W&B dashboard)."""
    return ",".join(override.lstrip("+~") for override in task_overrides) or fallback


@dataclass
class JobOutcome:
    num: int
    overrides: list[str]
    status: str  # COMPLETED, FAILED, CANCELLED, TIMEOUT, ... (Slurm's words where Slurm ended it)
    run_dir: str
    error: str | None = None
    job_id: str | None = None  # the scheduler's id (Slurm: ARRAYID_TASK, as squeue and sacct show it)
    steps: int = 0  # steps logged to metrics.jsonl
    final_loss: float | None = None
    final_reward: float | None = None  # an RL job's last train/reward (None for SFT)
    objective: float | None = None  # what the job returned to the sweeper (trainer.objective)
    metric: str | None = None  # trainer.objective and its mode, as its objective.json names them (None: no file)
    mode: str | None = None
    higher_is_better: bool = False  # trainer.objective_mode=max: the highest objective is the best
    branch_from: str | None = None  # a branch's trunk run dir (job.json's lineage), its steps before branch_step
    branch_step: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "COMPLETED"


@dataclass(eq=False)  # a handle is itself: a dict key, found by identity
class StartedJob:
    """A job that a launcher's `start` (hydra_plugins/tinker_exp_plugins/launchers.py) started.

    Its number, its overrides, and submitit's job; `job` None: the point was refused by the checks (`refused` says why)
    and has ended already, without a job."""

    num: int
    overrides: list[str]
    job: Any = None
    refused: str | None = None
    settling: Settling = field(default_factory=Settling)  # Slurm: how long an ended-looking state has held
    written_since: float | None = None  # Slurm: when its result was first seen (it may still be leaving the queue)


def read_outcome(
    num: int,
    overrides: Sequence[str],
    status: str,
    run_dir: Path,
    error: str | None,
    job_id: str | None = None,
    objective: float | None = None,
) -> JobOutcome:
    """What a job left in its run dir (whatever it got to before it ended), and the objective it returned."""
    outcome = JobOutcome(num, list(overrides), status, str(run_dir), error, job_id, objective=objective)
    end = read_run_end(run_dir)
    outcome.higher_is_better = was_maximised(end)
    outcome.metric, outcome.mode = end.get("metric"), end.get("mode")
    job = run_dir / JOB_FILE
    try:
        lineage = json.loads(job.read_text()).get("branch") if job.is_file() else None
    except (OSError, ValueError, AttributeError):  # a job killed while writing it: no lineage, the rest still counts
        lineage = None
    if isinstance(lineage, dict):
        outcome.branch_from, outcome.branch_step = lineage.get("from"), lineage.get("step")
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        rows = read_jsonl(metrics)
        outcome.steps = len(rows)
        losses = [row["train/loss"] for row in rows if "train/loss" in row]
        outcome.final_loss = losses[-1] if losses else None
        rewards = [row["train/reward"] for row in rows if "train/reward" in row]
        outcome.final_reward = rewards[-1] if rewards else None
    return outcome


def ranked(outcomes: Sequence[JobOutcome]) -> list[JobOutcome]:
    """Best objective (lowest, or highest when maximised) first.

    Jobs without one (failed, dry runs) after, in job order."""
    return sorted(outcomes, key=lambda o: (o.objective is None, ranking_key(o.objective, o.higher_is_better), o.num))


def branches_line(branches: Sequence[tuple[str, int]]) -> str | None:
    """(trunk, branch step) of each branch, said once; None for no branch.

    "branch of T at step 4", "branches of T at steps 4, 8" ("; of " between trunks). The sweep's summary and its
    report.png say it so."""
    steps_of: dict[str, set[int]] = {}
    for trunk, step in branches:
        steps_of.setdefault(trunk, set()).add(step)
    if not steps_of:
        return None
    said = [f"{trunk} at {'step' if len(steps) == 1 else 'steps'} {', '.join(map(str, sorted(steps)))}"
            for trunk, steps in steps_of.items()]  # fmt: skip
    return f"{'branch' if len(branches) == 1 else 'branches'} of " + "; of ".join(said)


def budget_groups(outcomes: Sequence[JobOutcome]) -> list[list[JobOutcome]]:
    """Branches of more than one branch step, grouped by it, earliest first, each group ranked.

    The branch step is their budget: the trunk's steps they start from. Decays of one budget are compared with each
    other, not with another budget's. Anything else: one group, ranked."""
    steps = {(o.branch_from, o.branch_step) for o in outcomes if o.branch_from is not None}
    if len(steps) < 2 or any(o.branch_from is None for o in outcomes):
        return [ranked(outcomes)]
    return [ranked([o for o in outcomes if (o.branch_from, o.branch_step) == key])
            for key in sorted(steps, key=lambda key: (str(key[0]), key[1] or 0))]  # fmt: skip


def summary_table(outcomes: Sequence[JobOutcome]) -> str:
    """The sweep's summary table, sorted by objective, the best job marked with `*`.

    A sweep of branches says once where they came from, above the table (its steps column counts each branch's own
    steps), and branches of several branch steps are grouped by it, the best of each group marked."""
    rl = any(o.final_reward is not None for o in outcomes)  # an RL sweep: its reward, not its policy-gradient loss
    header = ["job", "overrides", "status", "steps", "final reward" if rl else "final loss",
              objective_header([(o.metric, o.mode) for o in outcomes if o.objective is not None]), "job id", "run dir"]  # fmt: skip
    final = (lambda o: o.final_reward) if rl else (lambda o: o.final_loss)
    groups = budget_groups(outcomes)
    ordered = [o for group in groups for o in group]
    # a pruned trial is never the best
    bests = [b for group in groups if (b := next((o for o in group if o.ok and o.objective is not None), None))]
    rows = [
        [
            f"*{o.num}" if any(o is b for b in bests) else str(o.num),
            " ".join(o.overrides) or "-",
            o.status,
            str(o.steps),
            "-" if final(o) is None else f"{final(o):.4f}",
            "-" if o.objective is None else f"{o.objective:.4f}",
            o.job_id or "-",
            o.run_dir,
        ]
        for o in ordered
    ]
    origin = branches_line([(o.branch_from, int(o.branch_step or 0)) for o in outcomes if o.branch_from is not None])
    if len(groups) > 1:
        origin += "; grouped by branch step (a budget), the best of each marked *"
    return (f"{origin}\n" if origin else "") + text_table(header, rows)


def objective_header(judged: Sequence[tuple[str | None, str | None]]) -> str:
    """The objective column's name: the metric and mode every judged run shares.

    E.g. "objective: eval/reward (max)"; plain "objective" when they differ or no run says."""
    if len(set(judged)) != 1 or None in judged[0]:
        return "objective"
    metric, mode = judged[0]
    return f"objective: {metric} ({mode})"


def write_summary(sweep_dir: Path, outcomes: Sequence[JobOutcome]) -> Path:
    """summary.md (the table, then each failure's error) and summary.jsonl (a row per job)."""
    failures = [f"- job {o.num} ({o.status}): {o.error}" for o in outcomes if not o.ok and o.error]
    rows = [asdict(o) for group in budget_groups(outcomes) for o in group]  # in the table's order
    return write_summary_files(sweep_dir, summary_table(outcomes), failures, rows)


def write_summary_files(sweep_dir: Path, table: str, failures: Sequence[str], rows: Sequence[dict[str, Any]]) -> Path:
    """Any sweep's summary.md (its table, then a line per failure) and summary.jsonl (`rows`, in order)."""
    text = "```\n" + table + "\n```\n" + ("\n" + "\n".join(failures) + "\n" if failures else "")
    (sweep_dir / SUMMARY_MD).write_text(text)
    with open(sweep_dir / SUMMARY_JSONL, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return sweep_dir / SUMMARY_MD


def points_at_once(cpus: int | None, workers_per_point: int, max_parallel: int | None) -> int:
    """How many points the local launcher runs at once.

    hydra.launcher.max_parallel when set, else as many as the machine's CPUs hold at one CPU a worker (more would only
    slow every point down, and can run it out of memory)."""
    if max_parallel is not None:
        return max_parallel
    return max(1, (cpus or 1) // max(1, workers_per_point))


def label(overrides: Sequence[str], num: int) -> str:
    """A job as the sweep's messages name it: its number and its overrides."""
    return f"job {num} [{' '.join(overrides)}]"


def bad_points_report(bad: Mapping[int, tuple[Sequence[str], str]], points: int) -> str:
    """Every point refused before the sweep started (num -> (overrides, its one-line error))."""
    lines = [f"{len(bad)} of {points} sweep points are wrong; no job was started:"]
    lines += [f"  {label(overrides, num)}: {error}" for num, (overrides, error) in sorted(bad.items())]
    return "\n".join(lines)


def failure_report(outcomes: Sequence[JobOutcome], summary: Path) -> str:
    """Every job that did not complete, with its overrides, why, and its run dir."""
    failed = [o for o in outcomes if not o.ok]
    lines = [f"{len(failed)} of {len(outcomes)} sweep jobs did not complete (summary: {summary}):"]
    lines += [f"  {label(o.overrides, o.num)} {o.status}: {o.error}; run dir {o.run_dir}" for o in failed]
    return "\n".join(lines)


RUN_DIRS: dict[tuple, tuple[Any, Path]] = {}
"""(the sweep's config's id, a job's overrides, its number) -> (that config, kept so that its id is not reused; the
job's run dir): composed once a job (a Hydra composition
takes 0.2-0.4 s on a loaded CPU, in the sweep's one thread; a study asks for a trial's run dir as it starts it and as
it ends; hydra_plugins' `job_run_dir`)."""


def run_dir_of(job_cfg: Any) -> Path:
    """A job's run dir, from its composed config with its `hydra` node (its number set)."""
    return Path(str(job_cfg.hydra.sweep.dir)) / str(job_cfg.hydra.sweep.subdir)
