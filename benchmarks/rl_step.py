"""Where an RL step's time goes: sampling, weight export, sampler reload, forward_backward, optimizer_step.

Runs README's RL command (env=digits loss=importance_sampling, the tiny model on 2 CPU workers; W&B off) `--runs`
times as a user runs it, and reads each run's metrics.jsonl: per step, the driver's sampling (HF generate, rewards,
advantages), the workers' weight export and the sampler's load of it, and the two worker calls. Prints each part's
median over the steps after the warm-up, per run, then the median over the runs of the share of a step that weight
export + sampler reload take (a step: the sum of the five parts).

    .venv/bin/python benchmarks/rl_step.py [--runs 2] [--steps 20] [--warmup 3] [ARGS...]   # ARGS: more overrides
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PARTS = ("perf/sampling_s", "perf/weight_export_s", "perf/sampler_load_s", "perf/forward_backward_s", "perf/optimizer_step_s")
SYNC = ("perf/weight_export_s", "perf/sampler_load_s")


def step_parts(rows: list[dict], warmup: int) -> dict[str, float]:
    """Each part's median over the steps after `warmup`, the step's (their sum) and the sync share's."""
    timed = [row for row in rows if row["train/step"] >= warmup and row["perf/weight_export_s"] > 0]  # an eval's export is shared
    medians = {part: statistics.median(row[part] for row in timed) for part in PARTS}
    totals = [sum(row[part] for part in PARTS) for row in timed]
    medians["step"] = statistics.median(totals)
    medians["sync_share"] = statistics.median(sum(row[p] for p in SYNC) / total for row, total in zip(timed, totals))
    return medians


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out (the first export, allocator warm-up)")
    args, extra = parser.parse_known_args()
    shares = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            command = [sys.executable, "-m", "tinker_exp", "env=digits", "loss=importance_sampling", f"trainer.steps={args.steps}",
                       "logger=none", "checkpoint.every_steps=0", "checkpoint.at_end=false", f"hydra.run.dir={tmp}", *extra]  # fmt: skip
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"run {run} failed ({done.returncode}): {done.stderr[-2000:]}")
            rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        parts = step_parts(rows, args.warmup)
        shares.append(parts["sync_share"])
        print(f"run {run}: " + ", ".join(f"{name.removeprefix('perf/').removesuffix('_s')} {value * 1000:.1f} ms"
                                         for name, value in parts.items() if name != "sync_share")
              + f"; export + reload {parts['sync_share']:.1%} of a step")  # fmt: skip
    print(f"weight export + sampler reload: median {statistics.median(shares):.1%} of a step over {args.runs} runs")


if __name__ == "__main__":
    main()
