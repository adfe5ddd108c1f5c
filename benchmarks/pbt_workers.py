"""A PBT population on Slurm: a job per member against population workers (hydra.launcher.workers), paired, on the
local Slurm cluster (launchers/local_slurm).

    launchers/local_slurm/up.sh 2 && source /tmp/tinker_exp_slurm/env.sh
    python benchmarks/pbt_workers.py [--population 4] [--steps 20] [--interval 5] [--workers 2] [--rounds 1]

Both sides are the same seeded population of LoRA members (lora=r8; start values drawn from the same seed):
`hparams_search=pbt_lr_cosine`'s space and boundaries on --steps steps, one Slurm job per member (one job array)
against --workers worker jobs of population/workers slots each (hydra.launcher.slots), which start their group once
and train their members at once on its slots. Prints, for each side: the sweep's wall time (from the command to
its exit: queue waits and cold starts counted), the cold starts (members whose workers were built for them: a job's
own, or a slot group `built for this trial`), the training time summed over members (first to last row of each), the
exploits made, and the best member's objective. The two sides' objectives are not compared bitwise: members decide
against the posts on the board when they reach a boundary, and which members have posted by then depends on timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from study_workers import REPO, timed_sweep  # this folder's: the same wall time and summary as a study's


def population(sweep_dir: Path, size: int, steps: int, interval: int, workers: int) -> dict:
    """One population: a job per member (`workers` 0), or on `workers` worker jobs of size/workers slots each."""
    slots = -(-size // workers) if workers else 0
    on_workers = [f"hydra.launcher.workers={workers}", f"hydra.launcher.slots={slots}"] if workers else []
    command = [
        sys.executable, "-m", "tinker_exp", "hparams_search=pbt_lr_cosine", "hydra/launcher=slurm_local", f"hydra.sweep.dir={sweep_dir}",
        f"hydra.sweeper.population={size}", f"hydra.sweeper.interval={interval}", f"trainer.eval_every={interval}",
        f"trainer.steps={steps}", "lora=r8", "logger=none", "backend.num_workers=1", *on_workers,
    ]  # fmt: skip
    wall, rows = timed_sweep(command, sweep_dir)
    cold, training = 0, 0.0
    for row in rows:
        run_dir = Path(row["run_dir"])
        run_log = (run_dir / "tinker_exp.log").read_text()
        cold += "built for this trial" in run_log if "on this process's group" in run_log else 1  # a job of its own: cold
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        training += metrics[-1]["time"] - metrics[0]["time"]
    best = min(rows, key=lambda row: row["objective"])
    return {"wall_s": wall, "cold_starts": cold, "training_s": training, "exploits": sum(row["n_exploits"] for row in rows),
            "best": (best["member"], best["objective"])}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--population", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="paired rounds (a job per member, then workers); medians")
    args = parser.parse_args()
    sides = {"a job per member": 0, f"{args.workers} population workers": args.workers}
    results: dict[str, list[dict]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory(prefix="pbt-workers-") as folder:
        for round_ in range(args.rounds):
            for name, workers in sides.items():
                result = population(Path(folder) / f"{round_}-{workers}", args.population, args.steps, args.interval, workers)
                results[name].append(result)
                print(f"round {round_}, {name}: wall {result['wall_s']:.1f} s, {result['cold_starts']} cold starts, training "
                      f"summed {result['training_s']:.1f} s, {result['exploits']} exploits, best member {result['best'][0]}: "
                      f"{result['best'][1]:.6g}", flush=True)  # fmt: skip
    base = statistics.median(r["wall_s"] for r in results["a job per member"])
    for name, runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        print(f"median, {name}: wall {wall:.1f} s ({base / wall:.2f}x a job per member's speed), cold starts "
              f"{statistics.median(r['cold_starts'] for r in runs):g}, training summed {statistics.median(r['training_s'] for r in runs):.1f} s")


if __name__ == "__main__":
    main()
