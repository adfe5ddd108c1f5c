"""Cost of the override plan at pretraining scale, against the floor: `python -m tinker_exp --cfg job` (Hydra's
compose, which every command pays).

- the whole dry run (CLI, plan.png included) of a four-key plan at 100,000 and 1,000,000 steps: wall time, each run
  paired with a floor run just before it (the ratio is taken per pair: a busy machine slows both), peak resident
  memory, and the size of the plan files it writes (targets at 1M: <= 4x the floor, < 200 MiB, < 10 MB);
- in process: building, checking and writing (plan.json; no plot) the 1,000,000-step plan (target < 0.5 s), and
  one step's OptimStepParams built for optimizer_step, as the loop does;
medians of --repeats runs (default 5).

    .venv/bin/python benchmarks/plan.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OVERRIDES = [
    "+override=[lr_wsd,beta2_warmup,wd_cosine]",
    "+override.eps={schedule:exponential,value:1e-8,gamma:0.99999}",
    "override.lr.decay_steps=20000",
]
OVERRIDE = {  # the same four keys in process, as the CLI composes them (the presets' fractions and null peaks)
    "lr": {"schedule": "wsd", "value": None, "warmup_steps": 0.05, "decay_steps": 20000, "decay_shape": "1-sqrt", "min_ratio": 0.1},
    "betas": [0.9, {"schedule": "linear", "start": 0.95, "end": None}],
    "weight_decay": {"schedule": "cosine", "value": None, "min_ratio": 0.0},
    "eps": {"schedule": "exponential", "value": 1e-8, "gamma": 0.99999},
}
MiB = 1024 * 1024


def timed(cmd: list[str]) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak resident MiB) of one command."""
    start = time.perf_counter()
    process = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{process.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024  # ru_maxrss is in KiB on Linux


def dry_runs(steps: int, repeats: int) -> dict[str, float]:
    """Floor and dry run alternated; medians of the walls, of the per-pair ratios (wall, and CPU: what a machine
    shared with other work does not blur) and of the peaks."""
    floor_cmd = [sys.executable, "-m", "tinker_exp", *OVERRIDES, f"trainer.steps={steps}", "--cfg", "job"]
    walls, floors, ratios, cpu_ratios, peaks = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            floor, floor_cpu, _ = timed(floor_cmd)
            run_dir = Path(tmp) / str(i)
            wall, cpu, peak = timed([sys.executable, "-m", "tinker_exp", *OVERRIDES, f"trainer.steps={steps}", "dry_run=true",
                                f"hydra.run.dir={run_dir}"])  # fmt: skip
            walls.append(wall), floors.append(floor), ratios.append(wall / floor), peaks.append(peak)
            cpu_ratios.append(cpu / floor_cpu)
        files = {path.name: path.stat().st_size for path in run_dir.glob("plan.*")}
    return {"wall": statistics.median(walls), "floor": statistics.median(floors), "ratio": statistics.median(ratios),
            "cpu_ratio": statistics.median(cpu_ratios), "peak": statistics.median(peaks), "files": sum(files.values()),
            "names": ", ".join(sorted(files))}  # fmt: skip


def in_process(steps: int, repeats: int) -> dict[str, float]:
    from tinker_exp.config import OptimizerConfig
    from tinker_exp.optim.plan import build_plan
    from tinker_exp.optim.preview import write_plan_file

    builds, writes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            start = time.perf_counter()
            plan = build_plan(OVERRIDE, OptimizerConfig(), steps)
            built = time.perf_counter()
            write_plan_file(plan, Path(tmp) / "plan.json")
            builds.append(built - start), writes.append(time.perf_counter() - built)
    start = time.perf_counter()
    for step in range(0, steps, 10):
        plan[step]
    per_step = (time.perf_counter() - start) / len(range(0, steps, 10))
    arrays = sum(column.nbytes for column in plan.columns.values() if not isinstance(column, float))
    totals = [b + w for b, w in zip(builds, writes)]
    return {"build": statistics.median(builds), "write": statistics.median(writes), "total": statistics.median(totals),
            "step_us": per_step * 1e6, "arrays": arrays / MiB}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    # The dry runs first: a child forked from this process counts its pages (a built plan) in its peak.
    for steps in (100_000, 1_000_000):
        cli = dry_runs(steps, args.repeats)
        print(f"dry run CLI with plan.png, {steps:,} steps (median of {args.repeats} pairs):")
        print(f"  --cfg job (the floor)                : {cli['floor']:7.2f} s wall")
        print(f"  dry run                              : {cli['wall']:7.2f} s wall   {cli['ratio']:.1f}x the floor (target <= 4x)")
        print(f"  CPU time (user + sys), dry run/floor :             {cli['cpu_ratio']:.1f}x")
        print(f"  peak resident                        : {cli['peak']:7.0f} MiB        (target < 200 MiB)")
        print(f"  plan files ({cli['names']})     : {cli['files'] / 1e6:7.3f} MB         (target < 10 MB)")
    local = in_process(1_000_000, args.repeats)
    print(f"in process, 1,000,000 steps, 4 scheduled keys (median of {args.repeats}):")
    print(f"  build + check                        : {local['build']:7.3f} s")
    print(f"  write plan.json                      : {local['write']:7.3f} s")
    print(f"  build + check + write                : {local['total']:7.3f} s   (target < 0.5 s)")
    print(f"  the plan's arrays, held by the driver: {local['arrays']:7.1f} MiB")
    print(f"  one step's OptimStepParams (plan[s]) : {local['step_us']:7.2f} us")

if __name__ == "__main__":
    main()
