"""The start of a branch costs what a resume costs: paired runs through the real CLI, medians and ratios.

A trunk once (`--steps` steps, a checkpoint every `--at` steps; keep_last keeps both). Then per pair, in an order
that alternates (resume first in even pairs, branch first in odd ones), each its own `python -m tinker_exp`
process with the same config as the trunk:
- resume: a copy of the trunk's run dir with its newest checkpoint removed, so the same command resumes at
  step `--at` (metrics.jsonl drops the rows from that step on);
- branch: `branch.from=<trunk> branch.step=<at>` in a new run dir.
Per run: process start to the first metrics.jsonl row of step `--at` (its `time` against the start time taken
here just before the process is started) and the process's wall time. Printed: each pair, the medians, the ratio
of the medians (branch / resume) and the per-pair ratios.

    .venv/bin/python benchmarks/branch_start.py [--pairs 3] [--steps 8] [--at 4] [--set KEY=VALUE ...] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_cli(args: list[str]) -> tuple[float, float]:
    """Run `python -m tinker_exp ARGS` in its own process; (its start time, its wall time). Exits on failure."""
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"), "PYTHONPATH": str(REPO)}
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "tinker_exp", *args], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if done.returncode != 0:
        sys.exit(f"tinker_exp {' '.join(args)} failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return start, wall


def first_row_time(run_dir: Path, step: int) -> float:
    """The `time` of the first metrics.jsonl row of `step` (a resume's copy holds no row of it: they were dropped)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return next(row["time"] for row in rows if row.get("train/step") == step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3, help="resume/branch pairs")
    parser.add_argument("--steps", type=int, default=8, help="trainer.steps of every run")
    parser.add_argument("--at", type=int, default=4, help="the checkpoint step a resume and a branch start from")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides, every run")
    parser.add_argument("--keep", type=Path, help="put the run dirs here and keep them (default: a temp dir, removed)")
    args = parser.parse_args()
    if not 0 < args.at < args.steps or args.steps % args.at:
        sys.exit("--at must be below --steps and divide it (the trunk checkpoints every --at steps)")

    common = ["+override=constant", f"trainer.steps={args.steps}", f"checkpoint.every_steps={args.at}", *args.set]
    step_dir = f"step_{args.steps:08d}"  # the trunk's newest checkpoint, removed from a resume's copy
    with tempfile.TemporaryDirectory(prefix="branch_start_") as tmp:
        root = args.keep.resolve() if args.keep else Path(tmp)
        trunk = root / "trunk"
        _, trunk_wall = run_cli([*common, f"hydra.run.dir={trunk}"])
        print(f"trunk: {args.steps} steps, checkpoints {sorted(p.name for p in (trunk / 'checkpoints').glob('step_*'))}, {trunk_wall:.1f} s")

        def resume(pair: int) -> tuple[float, float]:
            run_dir = root / f"resume_{pair}"
            shutil.copytree(trunk, run_dir)
            shutil.rmtree(run_dir / "checkpoints" / step_dir)
            start, wall = run_cli([*common, f"hydra.run.dir={run_dir}"])
            return first_row_time(run_dir, args.at) - start, wall

        def branch(pair: int) -> tuple[float, float]:
            run_dir = root / f"branch_{pair}"
            start, wall = run_cli([*common, f"branch.from={trunk}", f"branch.step={args.at}", f"hydra.run.dir={run_dir}"])
            return first_row_time(run_dir, args.at) - start, wall

        results: dict[str, list[tuple[float, float]]] = {"resume": [], "branch": []}
        for pair in range(args.pairs):
            order = ["resume", "branch"] if pair % 2 == 0 else ["branch", "resume"]
            for kind in order:
                results[kind].append((resume if kind == "resume" else branch)(pair))
            (r_first, r_wall), (b_first, b_wall) = results["resume"][-1], results["branch"][-1]
            print(f"pair {pair} ({' then '.join(order)}): to step {args.at}'s row: resume {r_first:.2f} s, branch {b_first:.2f} s"
                  f" (ratio {b_first / r_first:.3f}); wall: resume {r_wall:.2f} s, branch {b_wall:.2f} s (ratio {b_wall / r_wall:.3f})")  # fmt: skip

    for index, label in [(0, f"start to step {args.at}'s first row"), (1, "wall time")]:
        resumes = [run[index] for run in results["resume"]]
        branches = [run[index] for run in results["branch"]]
        ratios = [b / r for b, r in zip(branches, resumes)]
        print(f"{label}: median resume {statistics.median(resumes):.2f} s, branch {statistics.median(branches):.2f} s;"
              f" ratio of medians {statistics.median(branches) / statistics.median(resumes):.3f};"
              f" per-pair ratios {', '.join(f'{ratio:.3f}' for ratio in ratios)}")  # fmt: skip


if __name__ == "__main__":
    main()
