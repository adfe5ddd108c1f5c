"""Draw any runs together: runs of different sweeps, a sweep's jobs, single runs, each labelled by what differs.

    python -m tinker_exp.report RUN_DIR|SWEEP_DIR... [-o OUT.png]

A sweep dir stands for its jobs (its numbered run dirs). OUT defaults to report.png in the one dir given, else
in the current dir. A study's dir (optuna.journal, or an earlier optuna.db) given alone also gets study.png there (with -o: OUT's stem +
"_study.png"): the objective against each searched parameter. Prints each file it wrote. A path that does not
exist, or is neither a run dir nor a sweep dir: one line, exit 2. Pure Python (matplotlib; optuna for a study).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from tinker_exp.errors import ConfigError
from tinker_exp.formats import not_a_folder
from tinker_exp.sweep.jobs import JOB_FILE
from tinker_exp.sweep.report import REPORT, STUDY_REPORT, display_name, title_name, write_report, write_study_report
from tinker_exp.sweep.study import open_storage, study_in

RUN_FILES = (JOB_FILE, "metrics.jsonl")  # every run writes job.json first; a run dir from elsewhere has metrics


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in RUN_FILES)


def jobs_of(sweep_dir: Path) -> list[Path]:
    """A sweep's run dirs (hydra.sweep.subdir: the job number), in job order."""
    jobs = [d for d in sweep_dir.iterdir() if is_run_dir(d)] if sweep_dir.is_dir() else []
    return sorted(jobs, key=lambda d: (not d.name.isdigit(), int(d.name) if d.name.isdigit() else 0, d.name))


def runs_of(paths: Sequence[Path]) -> list[tuple[str, Path]]:
    """(name, run dir) for every run the paths stand for.

    One sweep: its jobs named by number ("job 3", a study's "trial 3"); several paths: each run named by the end of its
    path that tells it apart."""
    dirs: list[Path] = []
    for path in paths:
        if not path.exists():
            raise ConfigError(f"{path}: no such file or directory")
        if is_run_dir(path):
            dirs.append(path)
        elif jobs := jobs_of(path):
            dirs += jobs
        else:
            raise ConfigError(f"{path}: not a run dir (no {' or '.join(RUN_FILES)}) nor a sweep dir of run dirs")
    if len(paths) == 1 and not is_run_dir(paths[0]):
        word = "trial" if study_in(paths[0]) else "job"
        return [(f"{word} {d.name}", d) for d in dirs]
    if len(dirs) == 1:
        return [("", dirs[0])]
    return list(zip(distinct_names(dirs), dirs))


def distinct_names(dirs: Sequence[Path]) -> list[str]:
    """Short names that tell the dirs apart.

    A sweep's job with its sweep (08-37-19/1), a run by its own name (08-36-42-416363); longer ends of their names below
    outputs/ where those are alike."""
    parts = [display_name(d).split("/") for d in dirs]
    for extra in range(max(len(p) for p in parts)):
        names = ["/".join(p[-(extra + (2 if p[-1].isdigit() else 1)) :]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(d) for d in dirs]  # the same dir twice


def title(paths: Sequence[Path], runs: Sequence[tuple[str, Path]]) -> str:
    if len(paths) == 1:
        path = paths[0]
        if is_run_dir(path):
            return f"run {title_name(path)}"
        return f"{'study' if study_in(path) else 'sweep'} {display_name(path)}"
    return f"{len(runs)} runs: " + ", ".join(display_name(path) for path in paths)


def load_study(sweep_dir: Path):  # -> optuna.Study | None
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.load_study(study_name=None, storage=open_storage(study_in(sweep_dir)))
    except ValueError:  # several studies in the one storage: the picture of runs is still drawn
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tinker_exp.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, metavar="RUN_DIR", help="run dirs and sweep dirs")
    parser.add_argument("-o", "--out", type=Path, help=f"the PNG to write (default: {REPORT} in the one dir given, else here)")
    args = parser.parse_args(argv)
    try:
        runs = runs_of(args.paths)
        out = args.out or ((args.paths[0] if len(args.paths) == 1 else Path.cwd()) / REPORT)
        if out.suffix.lower() != ".png":
            raise ConfigError(f"-o {out}: the report is a PNG; name it *.png")
        if not out.parent.is_dir():
            raise ConfigError(f"-o {out}: {not_a_folder(out.parent) or f'no such directory {out.parent}'}")
    except ConfigError as e:
        print(f"tinker_exp.report: {e}", file=sys.stderr)
        return e.exit_code
    written = write_report(runs, out, title(args.paths, runs))
    if written is None:
        print(f"tinker_exp.report: no run logged a step ({', '.join(str(d) for _, d in runs)}); nothing drawn", file=sys.stderr)
        return 1
    print(written)
    if len(args.paths) == 1 and study_in(args.paths[0]):
        study = load_study(args.paths[0])
        beside = out.with_name(STUDY_REPORT if args.out is None else out.stem + "_study.png")
        picture = study and write_study_report(study, beside, title(args.paths, runs))
        if picture:
            print(picture)
    return 0


if __name__ == "__main__":
    sys.exit(main())
