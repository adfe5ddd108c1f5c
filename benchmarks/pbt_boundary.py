"""What a population member's boundary costs, with and without an exploit, against one training step and a job start:
runs through the real CLI, medians and ratios.

A donor run once (`--steps` steps, a checkpoint every `--interval` steps, all kept; or `--donor`: a run dir that
holds checkpoints at those steps); its checkpoints are posted to
a board as member 1's, with score 0 (better than any loss), at every boundary. Then per round, in an order that
rotates, each its own `python -m tinker_exp` process with the same config:
- plain: an ordinary run (no population), evaluating at the same steps;
- carry on: member 0 of a population alone on an empty board: at each boundary it saves, posts, ranks 1 of 1;
- exploit: member 0 on the donor's board: at each boundary it saves, posts, ranks 2 of 2 and loads the donor's
  checkpoint into its running workers, then goes on with an explored plan.
At a boundary step s, the time between the rows of steps s - 1 and s (each row's `time`) less the evaluation
(`perf/eval_time_s` of step s - 1) and step s's own `perf/step_time_s` is what happens between two steps; the plain
run's same gap (logging, the next batch) is subtracted to give the boundary's cost. A job start: process start to
the first row, less that step's time, in the plain run. Printed: each run, the medians and the ratios.

    .venv/bin/python benchmarks/pbt_boundary.py [--rounds 3] [--steps 8] [--interval 2] [--set KEY=VALUE ...] [--keep DIR]
        [--donor RUN_DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from optuna.distributions import FloatDistribution, distribution_to_json  # noqa: E402

from tinker_exp.sweep.pbt import POPULATION_ENV, post  # noqa: E402


def run_cli(args: list[str], env: dict[str, str] | None = None) -> float:
    """Run `python -m tinker_exp ARGS` in its own process; returns its start time. Exits on failure."""
    merged = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"), "PYTHONPATH": str(REPO), **(env or {})}
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "tinker_exp", *args], cwd=REPO, env=merged, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"tinker_exp {' '.join(args)} failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return start


def rows_of(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["train/step"]: row for row in rows}


def gaps(run_dir: Path, boundaries: list[int]) -> list[float]:
    """Per boundary s: the time between steps s - 1 and s that neither the evaluation nor step s itself took."""
    rows = rows_of(run_dir)
    return [rows[s]["time"] - rows[s - 1]["time"] - rows[s - 1]["perf/eval_time_s"] - rows[s]["perf/step_time_s"] for s in boundaries]


def population(board: Path, interval: int) -> dict[str, str]:
    told = {"board": str(board), "population": 2, "interval": interval, "seed": 0, "resample_probability": 0.25,
            "space": {"override.lr.value": distribution_to_json(FloatDistribution(1e-4, 3e-3, log=True))}}  # fmt: skip
    return {POPULATION_ENV: json.dumps(told)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (plain, carry on, exploit)")
    parser.add_argument("--steps", type=int, default=8, help="trainer.steps of every run")
    parser.add_argument("--interval", type=int, default=2, help="steps between boundaries (and evaluations)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides, every run")
    parser.add_argument("--keep", type=Path, help="put the run dirs here and keep them (default: a temp dir, removed)")
    parser.add_argument("--donor", type=Path, help="a run dir whose checkpoints at the boundaries are the donor's (default: "
                        "a run trained first with the same config); the tests pass a population member's")  # fmt: skip
    args = parser.parse_args()
    boundaries = list(range(args.interval, args.steps, args.interval))
    if not boundaries:
        sys.exit("--steps must be at least 2 * --interval: no boundary otherwise")

    common = ["+override=lr_cosine", "override.lr.warmup_steps=2", "override.lr.value=1e-3", f"trainer.steps={args.steps}",
              f"trainer.eval_every={args.interval}", "checkpoint.every_steps=0", "logger=none", *args.set]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="pbt_boundary_") as tmp:
        root = args.keep.resolve() if args.keep else Path(tmp)
        donor = args.donor.resolve() if args.donor else root / "donor"
        if not args.donor:
            run_cli([*common, f"checkpoint.every_steps={args.interval}", "checkpoint.keep_last=0", f"hydra.run.dir={donor}"])
        for s in boundaries:
            if not (donor / "checkpoints" / f"step_{s:08d}" / "MANIFEST.json").is_file():
                sys.exit(f"{donor}: no checkpoint at step {s}, a boundary")
            post(root / "donor_board", 1, s, 0.0, donor / "checkpoints" / f"step_{s:08d}", {"override.lr.value": 1e-3})

        def plain(r: int) -> tuple[list[float], float, float]:
            run_dir = root / f"plain_{r}"
            start = run_cli([*common, f"hydra.run.dir={run_dir}"])
            rows = rows_of(run_dir)
            step_times = [row["perf/step_time_s"] for row in rows.values()]
            return gaps(run_dir, boundaries), rows[0]["time"] - rows[0]["perf/step_time_s"] - start, statistics.median(step_times)

        def member(kind: str, r: int) -> list[float]:
            sweep = root / f"{kind}_{r}"
            board = root / "donor_board" if kind == "exploit" else sweep / "population"
            run_cli(["-m", "hydra/launcher=local", *common, f"hydra.sweep.dir={sweep}"], population(board, args.interval))
            decided = [json.loads(line) for line in (sweep / "0" / "population.jsonl").read_text().splitlines()]
            assert [bool(row["exploit"]) for row in decided] == [kind == "exploit"] * len(boundaries), decided
            return gaps(sweep / "0", boundaries)

        results: dict[str, list] = {"plain": [], "carry on": [], "exploit": []}
        kinds = list(results)
        for r in range(args.rounds):
            order = kinds[r % 3 :] + kinds[: r % 3]
            for kind in order:
                results[kind].append(plain(r) if kind == "plain" else member(kind, r))
            (plain_gaps, start_s, step_s), carry, exploit = results["plain"][-1], results["carry on"][-1], results["exploit"][-1]
            print(f"round {r} ({' then '.join(order)}): between steps at the boundaries: plain {', '.join(f'{g:.3f}' for g in plain_gaps)} s;"
                  f" carry on {', '.join(f'{g:.3f}' for g in carry)} s; exploit {', '.join(f'{g:.3f}' for g in exploit)} s;"
                  f" median step {step_s:.3f} s; job start {start_s:.2f} s")  # fmt: skip

    plain_gap = statistics.median(g for run in results["plain"] for g in run[0])
    step = statistics.median(run[2] for run in results["plain"])
    start = statistics.median(run[1] for run in results["plain"])
    print(f"medians: one training step {step:.3f} s; a job start (process start to its first step) {start:.2f} s; plain run between steps {plain_gap:.3f} s")
    for kind in ("carry on", "exploit"):
        cost = statistics.median(g for run in results[kind] for g in run) - plain_gap
        print(f"a boundary that {'exploits' if kind == 'exploit' else 'carries on'}: {cost:.3f} s"
              f" = {cost / step:.2f} training steps = {cost / start:.3f} job starts")  # fmt: skip


if __name__ == "__main__":
    main()
