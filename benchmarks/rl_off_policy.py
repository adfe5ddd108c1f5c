"""Synchronous against off-policy RL (rl.max_steps_off_policy=k): wall time, reward curve and the step's split.

Runs `env=digits loss=stable_reinforce +override=lr_cosine trainer.steps=40` (the tiny model on 2 CPU workers, W&B
and checkpoints off) as a user runs it, for each seed and each k, the k's of one seed back to back in a rotating
order (paired: the machine's load drifts between seeds, less within one). Per run: the loop's wall time (row 39's
time less row 0's: 39 steps, evaluations included), the process's, eval/reward after 10, 20, 30, 40 steps, and
each part of a step as its median over the steps after the first k + 1 (sampling, waiting for a batch, weight
export, sampler load, forward_backward, optimizer_step). Then per k: the median over seeds of the loop time as a
share of the synchronous run's of the same seed, and the final eval/reward's mean and spread (min, max) over seeds.
The load average is printed around every run (the machine is shared).

    .venv/bin/python benchmarks/rl_off_policy.py [--seeds 0 1 2] [--ks 0 1 2] [--steps 40] [ARGS...]   # ARGS (overrides) after --steps
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
PARTS = ("perf/sampling_s", "perf/sample_wait_s", "perf/weight_export_s", "perf/sampler_load_s",
         "perf/forward_backward_s", "perf/optimizer_step_s")  # fmt: skip


def run(seed: int, k: int, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "tinker_exp", "env=digits", "loss=stable_reinforce", "+override=lr_cosine",
                   f"trainer.steps={steps}", f"trainer.seed={seed}", f"rl.max_steps_off_policy={k}", "logger=none",
                   "checkpoint.every_steps=0", "checkpoint.at_end=false", f"hydra.run.dir={tmp}", *extra]  # fmt: skip
        load = os.getloadavg()[0]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode:
            sys.exit(f"seed {seed} k {k} failed ({done.returncode}): {done.stderr[-2000:]}")
        rows = [r for r in (json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()) if "train/step" in r]
    timed = [row for row in rows if row["train/step"] > k]
    # a synchronous step waits for its whole sampling
    parts = {p: statistics.median(row.get(p, row["perf/sampling_s"] if p == "perf/sample_wait_s" else 0.0) for row in timed) for p in PARTS}
    return {
        "seed": seed, "k": k, "loop_s": rows[-1]["time"] - rows[0]["time"], "wall_s": wall, "load": (load, os.getloadavg()[0]),
        "eval": [row["eval/reward"] for row in rows if "eval/reward" in row], "reward": [row["train/reward"] for row in rows],
        "parts": parts,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    args, extra = parser.parse_known_args()
    results = []
    for i, seed in enumerate(args.seeds):
        order = args.ks[i % len(args.ks):] + args.ks[: i % len(args.ks)]
        for k in order:
            r = run(seed, k, args.steps, extra)
            results.append(r)
            split = ", ".join(f"{p.removeprefix('perf/').removesuffix('_s')} {v * 1000:.0f}" for p, v in r["parts"].items())
            print(f"seed {seed} k {k}: loop {r['loop_s']:.1f} s (process {r['wall_s']:.1f} s), load {r['load'][0]:.2f} -> "
                  f"{r['load'][1]:.2f}; eval/reward {', '.join(f'{e:.3f}' for e in r['eval'])}; step parts (ms): {split}", flush=True)
    sync = {r["seed"]: r["loop_s"] for r in results if r["k"] == 0}
    for k in args.ks:
        mine = [r for r in results if r["k"] == k]
        finals = [r["eval"][-1] for r in mine]
        ratio = statistics.median(r["loop_s"] / sync[r["seed"]] for r in mine) if sync else float("nan")
        curve = [statistics.mean(r["reward"][s] for r in mine) for s in range(0, args.steps, 5)]
        print(f"k {k}: loop time {statistics.median(r['loop_s'] for r in mine):.1f} s median, {ratio:.2f}x the synchronous "
              f"(median over seeds of the paired ratio); final eval/reward mean {statistics.mean(finals):.3f} "
              f"[{min(finals):.3f}, {max(finals):.3f}]; train/reward mean every 5 steps {', '.join(f'{c:.2f}' for c in curve)}")


if __name__ == "__main__":
    main()
