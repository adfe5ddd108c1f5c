"""What pruning saves in an Optuna study, and what one report to the study costs a job.

Studies (default): per seed (the sweeper's `seed`), the same fixed study twice, `hydra.sweeper.pruner=none` and
`pruner=median`, in an order that alternates (none first for the 1st, 3rd, ... seed), each a real
`python -m tinker_exp -m hydra/sweeper=optuna hydra/launcher=local ...` process in its own sweep dir, as a user
runs it. The study: the tiny model, `+override=lr_cosine` searched over `override.lr.value` (log, 1e-4 to 3e-3)
and `override.lr.warmup_steps` (0 to 5 steps), `--trials` trials, `--jobs` at a time (one Ray CPU worker each,
`hydra.launcher.max_parallel` = `--jobs`), `--steps` steps, an evaluation every `--eval-every` steps on the
default validation split, judged by the last val/loss, TPE random for its first `--tpe-startup` trials, W&B off.
The median pruner: `n_startup_trials` (`--prune-startup`: completed trials before it judges) and `n_warmup_steps`
(`--prune-warmup`: train/step of the first evaluation it judges; evaluations log at train/step eval_every-1,
2*eval_every-1, ...). From each study's optimization_results.yaml: steps trained, steps without pruning, the best
value; the process's wall time; and the jobs' time (each trial's tinker_exp.log, first line to last, summed).
Printed: each seed's figures and ratios (median / none), the medians of the ratios, and whether the pruned
studies' best values lie within the spread of the unpruned ones.

The sweeper keeps `--jobs` trials running (a pruned trial's slot is refilled at once), but each job starts its
own Ray and loads verl (seconds, beside a second or two of training on the tiny model): the wall-time ratio is
far above the steps ratio. The jobs' time (each trial's own, summed) leaves out what the sweeper does between
trials: what the trials cost. On a shared machine both are noisy.

Report cost (`--report-cost`): a study in a journal file (a temp dir) or at `--storage URL` (a throwaway study
there, deleted after), with the median pruner and `--others` completed trials of `--calls` evaluations each; a
new trial, opened as a job opens it (`TrialReport`: load the study, find the trial); then `--calls` calls of
`TrialReport.seen` (report + should_prune), one per evaluation at the others' steps, each timed. Printed: the
open once, and the median, p90 and worst of the calls, in ms.

    .venv/bin/python benchmarks/pruning.py [--seeds 0 1 2] [--trials 12] [--jobs 2] [--steps 12] [--eval-every 2]
        [--prune-startup 2] [--prune-warmup 1] [--tpe-startup 4] [--set KEY=VALUE ...] [--keep DIR]
    .venv/bin/python benchmarks/pruning.py --report-cost [--storage URL] [--calls 50] [--others 4]
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEARCH = ["override.lr.value=tag(log, interval(1e-4, 3e-3))", "override.lr.warmup_steps=int(interval(0, 5))"]
PRUNERS = ("none", "median")
LOG_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")  # tinker_exp.log's lines: [2026-12-01 11:57:30,460]


def study_command(args: argparse.Namespace, seed: int, pruner: str, sweep_dir: Path) -> list[str]:
    """The study as a user types it (one argument per shell word)."""
    command = [
        "-m", "hydra/sweeper=optuna", "hydra/launcher=local", f"hydra.sweep.dir={sweep_dir}", "+override=lr_cosine", *SEARCH,
        f"hydra.sweeper.n_trials={args.trials}", f"hydra.sweeper.n_jobs={args.jobs}", f"hydra.launcher.max_parallel={args.jobs}",
        f"hydra.sweeper.seed={seed}", f"hydra.sweeper.n_startup_trials={args.tpe_startup}",
        f"trainer.steps={args.steps}", f"trainer.eval_every={args.eval_every}", "backend.num_workers=1", "logger=none",
        f"hydra.sweeper.pruner={pruner}",
    ]  # fmt: skip
    if pruner == "median":
        command += [
            f"+hydra.sweeper.pruner_args.n_startup_trials={args.prune_startup}",
            f"+hydra.sweeper.pruner_args.n_warmup_steps={args.prune_warmup}",
        ]
    return command + args.set


def run_study(command: list[str]) -> float:
    """Run `python -m tinker_exp COMMAND`; its wall time. Exits on failure."""
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"), "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tinker_exp", *command], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"tinker_exp {' '.join(command)} failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return wall


def job_seconds(sweep_dir: Path) -> float:
    """Summed over the trials: each job's time from its tinker_exp.log's first line to its last (what the jobs
    held their slots for, without Python's start and the sweeper's work between trials)."""
    total = 0.0
    for log in sweep_dir.glob("*/tinker_exp.log"):
        stamps = [m.group(1) for m in map(LOG_STAMP.match, log.read_text(errors="replace").splitlines()) if m]
        if stamps:
            first, last = (datetime.datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f") for s in (stamps[0], stamps[-1]))
            total += (last - first).total_seconds()
    return total


def study_figures(sweep_dir: Path, wall: float) -> dict:
    import yaml

    saved = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    return {
        "wall": wall,
        "jobs": job_seconds(sweep_dir),
        "steps": saved["steps_trained"],
        "unpruned": saved["steps_without_pruning"],
        "best": saved["best_value"],
        "best_trial": saved["best_trial"],
        "n_trials": saved["n_trials"],
        "n_pruned": saved["n_pruned"],
        "n_failed": len(saved["failed"]),
        "pruned_at": sorted(p["step"] for p in saved["pruned"]),
    }


def shell_words(command: list[str]) -> str:
    import shlex

    return " ".join(shlex.quote(word) for word in command)


def studies(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="pruning_") as tmp:
        root = args.keep.resolve() if args.keep else Path(tmp)
        example = study_command(args, args.seeds[0], "median", root / "SWEEP_DIR")
        print(f"each study: python -m tinker_exp {shell_words(example)}")
        print("(pruner=none: the same without the pruner_args; hydra.sweeper.seed: each seed in turn)")
        figures: dict[int, dict[str, dict]] = {}
        for index, seed in enumerate(args.seeds):
            figures[seed] = {}
            for pruner in PRUNERS if index % 2 == 0 else PRUNERS[::-1]:  # alternate which runs first
                sweep_dir = root / f"seed{seed}_{pruner}"
                wall = run_study(study_command(args, seed, pruner, sweep_dir))
                figures[seed][pruner] = study_figures(sweep_dir, wall)
            for pruner in PRUNERS:
                f = figures[seed][pruner]
                best = "none completed" if f["best"] is None else f"{f['best']:.6g} (trial {f['best_trial']})"
                pruned = f", pruned at steps {f['pruned_at']}" if f["n_pruned"] else ""
                print(
                    f"seed {seed} {pruner:6}: {f['n_trials']} trials, {f['n_pruned']} pruned{pruned}, {f['n_failed']} failed; "
                    f"steps {f['steps']} of {f['unpruned']}; best {best}; wall {f['wall']:.1f} s, jobs {f['jobs']:.1f} s"
                )
            print(f"seed {seed} median / none: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios(figures[seed]).items()), flush=True)

    per_seed = [ratios(figures[seed]) for seed in args.seeds]
    print(f"medians of the per-seed ratios (median / none) over {len(args.seeds)} seed(s) (best: val/loss, a ratio above 1 is worse):")
    for key in ("steps", "wall", "jobs", "best"):
        values = [r[key] for r in per_seed if key in r]
        print(f"  {key}: {statistics.median(values):.3f}" if values else f"  {key}: no value")
    unpruned = [figures[s]["none"]["best"] for s in args.seeds if figures[s]["none"]["best"] is not None]
    pruned = [figures[s]["median"]["best"] for s in args.seeds if figures[s]["median"]["best"] is not None]
    if unpruned and pruned:
        low, high = min(unpruned), max(unpruned)
        print(f"best values: unpruned {', '.join(f'{v:.6g}' for v in unpruned)} (spread {low:.6g} to {high:.6g}); "
              f"pruned {', '.join(f'{v:.6g}' for v in pruned)} (median {statistics.median(pruned):.6g})")  # fmt: skip
        steps = statistics.median(r["steps"] for r in per_seed)
        print(
            f"goal: at most 60 % of the steps: {'met' if steps <= 0.6 else 'not met'} ({steps:.0%}); "
            f"pruned studies' median best within or below the unpruned spread: "
            f"{'met' if statistics.median(pruned) <= high else 'not met'}"
        )
    print(
        f"(wall times: the sweeper keeps {args.jobs} trials running, a pruned trial's slot refilled at once, and every "
        f"job starts its own Ray and verl; on a shared machine, noisy; jobs: the trials' times summed, "
        f"each from its log's first line to its last)"
    )


def ratios(pair: dict[str, dict]) -> dict[str, float]:
    """median / none of the steps trained, the wall time, the jobs' time and the best value (when both have one)."""
    none, median = pair["none"], pair["median"]
    out = {key: median[key] / none[key] if none[key] else math.nan for key in ("steps", "wall", "jobs")}
    if none["best"] is not None and median["best"] is not None:
        out["best"] = median["best"] / none["best"]
    return out


def report_cost(args: argparse.Namespace) -> None:
    import optuna

    from tinker_exp.formats import masked
    from tinker_exp.sweep.study import JOURNAL, TrialReport, open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    pruner_args = {"n_startup_trials": args.prune_startup, "n_warmup_steps": 0}
    steps = [(k + 1) * 2 - 1 for k in range(args.calls)]  # train/steps of evaluations every 2 steps
    with tempfile.TemporaryDirectory(prefix="report_cost_") as tmp:
        url = args.storage or JOURNAL + str(Path(tmp) / "optuna.journal")
        name = f"report-cost-{uuid.uuid4().hex[:8]}"  # a throwaway study, never one of a server's others
        try:
            study = optuna.create_study(study_name=name, storage=open_storage(url), direction="minimize")
        except Exception as e:  # no server, a bad URL: one line, the password masked
            sys.exit(f"--storage {masked(url)}: cannot open a study there: {masked(str(e).splitlines()[0] if str(e) else type(e).__name__)}")
        try:
            for other in range(args.others):  # what the median is taken over: completed trials' evaluations
                trial = study.ask()
                for k, step in enumerate(steps):
                    trial.report(2.0 + other * 0.1 - k * 0.001, step)
                study.tell(trial, 2.0 + other * 0.1 - args.calls * 0.001)
            number = study.ask().number
            start = time.perf_counter()
            report = TrialReport("val/loss", url, name, number, "median", pruner_args)
            opened = time.perf_counter() - start
            times, stopped = [], 0
            for k, step in enumerate(steps):
                row = {"train/step": step, "val/loss": 1.0 - k * 0.001}  # below every other trial: not pruned
                start = time.perf_counter()
                stopped += report.seen(k * 2 + 2, row)
                times.append(time.perf_counter() - start)
        finally:
            if args.storage:
                optuna.delete_study(study_name=name, storage=open_storage(url))
    ms = sorted(t * 1e3 for t in times)
    p90 = ms[min(len(ms) - 1, round(0.9 * (len(ms) - 1)))]
    kind = "journal file (temp dir)" if not args.storage else masked(args.storage)
    print(f"report cost: {kind}; median pruner, {args.others} other completed trials of {args.calls} evaluations each")
    print(f"  open (TrialReport: load the study, find the trial), once per job: {opened * 1e3:.1f} ms")
    print(f"  per evaluation (TrialReport.seen: report + should_prune), {args.calls} calls: "
          f"median {statistics.median(ms):.2f} ms, p90 {p90:.2f} ms, worst {ms[-1]:.2f} ms; {stopped} said prune")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the sweeper's seeds, one none/median pair each")
    parser.add_argument("--trials", type=int, default=12, help="hydra.sweeper.n_trials")
    parser.add_argument("--jobs", type=int, default=2, help="hydra.sweeper.n_jobs and hydra.launcher.max_parallel")
    parser.add_argument("--steps", type=int, default=12, help="trainer.steps of every trial")
    parser.add_argument("--eval-every", type=int, default=2, help="trainer.eval_every")
    parser.add_argument("--prune-startup", type=int, default=2, help="the median pruner's n_startup_trials")
    parser.add_argument("--prune-warmup", type=int, default=1, help="the median pruner's n_warmup_steps (a train/step; 1: from the first evaluation on)")
    parser.add_argument("--tpe-startup", type=int, default=4, help="hydra.sweeper.n_startup_trials (TPE's random trials)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides, every study")
    parser.add_argument("--keep", type=Path, help="put the sweep dirs here and keep them (default: a temp dir, removed)")
    parser.add_argument("--report-cost", action="store_true", help="time TrialReport.seen instead of running studies")
    parser.add_argument("--storage", help="with --report-cost: an Optuna storage URL (default: a journal file)")
    parser.add_argument("--calls", type=int, default=50, help="with --report-cost: timed calls (evaluations)")
    parser.add_argument("--others", type=int, default=4, help="with --report-cost: completed trials in the study")
    args = parser.parse_args()
    if min(args.trials, args.jobs, args.steps, args.eval_every, args.calls) < 1 or args.others < 0:
        sys.exit("--trials, --jobs, --steps, --eval-every and --calls must be >= 1, --others >= 0")
    report_cost(args) if args.report_cost else studies(args)


if __name__ == "__main__":
    main()
