"""An Optuna study on Slurm: a job per trial against study workers (hydra.launcher.workers), paired, on the local
Slurm cluster (launchers/local_slurm).

    launchers/local_slurm/up.sh 2 && source /tmp/tinker_exp_slurm/env.sh
    python benchmarks/study_workers.py [--trials 8] [--steps 20] [--workers 2]
    python benchmarks/study_workers.py --slots 4 [--trials 8] [--steps 20] [--workers 2]   # LoRA: 1 slot against 4

With `--slots K` both sides are LoRA studies (lora=r8) on `--workers` workers: one trial at a time on each worker's
pool against K trials at once on slots of each worker's group (hydra.launcher.slots=K, `n_jobs` W x K).

Both studies are the same seeded grid (`override.lr` over `--trials` points, so trial k gets the same point in both),
`hydra.sweeper.n_jobs` = `--workers` trials at a time, backend.pool=auto. Prints, for each: the sweep's wall time
(from the command to its exit: queue waits and cold starts counted), the cold starts (runs that built their workers:
a pool's first run says `group built`, a cold run does not say `pool: training on the warm workers`, a slot's trial
says its group was `built for this trial`), the training time summed over trials (first to last row of each
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


def timed_sweep(command: list[str], sweep_dir: Path) -> tuple[float, list[dict]]:
    """(the sweep's wall time, from the command to its exit, its summary.jsonl rows); a failed sweep ends the script."""
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return wall, [json.loads(line) for line in (sweep_dir / "summary.jsonl").read_text().splitlines()]


def study(sweep_dir: Path, trials: int, steps: int, workers: int, per_trial: bool, slots: int = 0) -> dict:
    """`slots`: 0, full fine-tuning; K >= 1, LoRA trials with hydra.launcher.slots=K."""
    points = ",".join(f"{1e-4 * (i + 1):.4g}" for i in range(trials))
    lora = ["lora=r8", f"hydra.launcher.slots={slots}"] if slots else []
    command = [
        sys.executable, "-m", "tinker_exp", "-m", "hydra/sweeper=optuna", "hydra/launcher=slurm_local", f"hydra.sweep.dir={sweep_dir}",
        "hydra.sweeper.sampler=grid", f"hydra.sweeper.n_trials={trials}", f"hydra.sweeper.n_jobs={workers * max(slots, 1)}",
        f"hydra.launcher.workers={0 if per_trial else workers}", f"override.lr=choice({points})", "+override=constant",
        f"trainer.steps={steps}", "logger=none", "backend.pool=auto", *lora,
    ]  # fmt: skip
    wall, rows = timed_sweep(command, sweep_dir)
    cold, training, objectives = 0, 0.0, {}
    for row in rows:
        run_dir = Path(row["run_dir"])
        run_log = (run_dir / "tinker_exp.log").read_text()
        on_slot = "on this process's group" in run_log  # a slot's trial: its group built for it, or for an earlier one
        cold += ("built for this trial" in run_log) if on_slot else ("group built" in run_log or "pool: training on the warm workers" not in run_log)
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
    parser.add_argument("--slots", type=int, default=0, help="LoRA trials: one a worker at a time against this many at once")
    args = parser.parse_args()
    if "SLURM_CONF" not in os.environ:
        raise SystemExit("source /tmp/tinker_exp_slurm/env.sh first (launchers/local_slurm/up.sh starts the cluster)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="study-workers-") as tmp:
        sides = [("job per trial", True, 0), (f"{args.workers} study workers", False, 0)]
        if args.slots:
            sides = [(f"{args.workers} workers, 1 slot", False, 1), (f"{args.workers} workers, {args.slots} slots", False, args.slots)]
        for name, per_trial, slots in sides:
            results[name] = study(Path(tmp) / name.replace(" ", "-").replace(",", ""), args.trials, args.steps, args.workers, per_trial, slots)
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
