"""An Optuna study on Slurm: a job per trial against study workers (hydra.launcher.workers), paired, on the local
Slurm cluster (launchers/local_slurm).

    launchers/local_slurm/up.sh 2 && source /tmp/tinker_exp_slurm/env.sh
    python benchmarks/study_workers.py [--trials 8] [--steps 20] [--workers 2]

Both studies are the same seeded grid (`override.lr` over `--trials` points, so trial k gets the same point in both),
`hydra.sweeper.n_jobs` = `--workers` trials at a time, backend.pool=auto. Prints, for each: the sweep's wall time
(from the command to its exit: queue waits and cold starts counted), the cold starts (runs that built their workers:
a pool's first run says `group built`, a cold run does not say `(warm: the pool's ...)`), the training time summed over trials (first to last row of each
run), and each trial's objective; then whether every trial's point and objective are the same in both (bitwise).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def study(sweep_dir: Path, trials: int, steps: int, workers: int, per_trial: bool) -> dict:
    points = ",".join(f"{1e-4 * (i + 1):.4g}" for i in range(trials))
    command = [
        sys.executable, "-m", "tinker_exp", "-m", "hydra/sweeper=optuna", "hydra/launcher=slurm_local", f"hydra.sweep.dir={sweep_dir}",
        "hydra.sweeper.sampler=grid", f"hydra.sweeper.n_trials={trials}", f"hydra.sweeper.n_jobs={workers}",
        f"hydra.launcher.workers={0 if per_trial else workers}", f"override.lr=choice({points})", "+override=constant",
        f"trainer.steps={steps}", "logger=none", "backend.pool=auto",
    ]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}: exit {done.returncode}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (sweep_dir / "summary.jsonl").read_text().splitlines()]
    cold, training, objectives = 0, 0.0, {}
    for row in rows:
        run_dir = Path(row["run_dir"])
        run_log = (run_dir / "tinker_exp.log").read_text()
        cold += "group built" in run_log or "(warm: the pool's" not in run_log  # a pool's first run builds its group
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        training += metrics[-1]["time"] - metrics[0]["time"]
        overrides = json.loads((run_dir / "job.json").read_text())["overrides"]
        objectives[row["num"]] = (next(o for o in overrides if o.startswith("override.lr=")), row["objective"])
    return {"wall_s": wall, "cold_starts": cold, "training_s": training, "objectives": objectives}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if "SLURM_CONF" not in os.environ:
        raise SystemExit("source /tmp/tinker_exp_slurm/env.sh first (launchers/local_slurm/up.sh starts the cluster)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="study-workers-") as tmp:
        for name, per_trial in (("job per trial", True), (f"{args.workers} study workers", False)):
            results[name] = study(Path(tmp) / name.replace(" ", "-"), args.trials, args.steps, args.workers, per_trial)
            r = results[name]
            print(
                f"{name:>16}: wall {r['wall_s']:.1f} s, {r['cold_starts']} cold starts, training {r['training_s']:.1f} s "
                f"summed over {args.trials} trials",
                flush=True,
            )
    (a, b) = (r["objectives"] for r in results.values())
    same = a == b  # point and objective per trial number, floats compared exactly
    print(f"same point and objective for every trial (bitwise): {same}")
    for number in sorted(a):
        print(f"  trial {number}: {a[number][0]}: {a[number][1]!r} | {b[number][1]!r}")


if __name__ == "__main__":
    main()
