"""Overhead of tinker_exp's loop over a bare loop that calls verl's worker group directly.

Both run the same tiny model, batch (8 sequences, micro batch 2) and 2 Ray CPU workers, each in its own
process. Prints the median step time (wall time between consecutive finished steps, logging included), the
median time per step outside verl's calls (that interval less the step's own train_step time: the loop's own
cost, paired within each step; its last column is the difference in ms, not a ratio) and the time from process start to
the end of the first step, for both, and their ratios.

    .venv/bin/python benchmarks/overhead.py [--steps 40] [--set KEY=VALUE ...]

`--set` passes a config override to the tinker_exp run only (e.g. `--set trainer.eval_every=0`: evaluation only
after the last step, which a median step time does not see). The bare loop trains on the same training rows
(the validation split held out), never evaluates.
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


def bare_loop(steps: int, out: Path) -> None:
    """No Hydra, no plan, no check, no sinks: verl's zero_grad / forward_backward / optimizer_step."""
    from hydra import compose, initialize_config_dir

    from tinker_exp import config
    from tinker_exp.runtime.inputs import load_examples, model_dir
    from tinker_exp.runtime.workers import TinkerWorkers
    from tinker_exp.train.data import batch_for_step, dataset_rows

    config.register()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        cfg = config.load(compose("config", overrides=[f"trainer.steps={steps}"]))
    model_path = model_dir(cfg.model)
    examples = load_examples(cfg.data, model_path, dataset_rows(cfg.data)[0], [])[0].examples
    values = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    workers = TinkerWorkers(cfg.backend, cfg.optimizer, cfg.trainer, str(model_path), values, "cpu")
    group = workers.group
    with open(out, "w") as f:
        for step in range(steps):
            start = time.perf_counter()  # the span tinker_exp's perf/step_time_s covers (its train_step)
            batch = workers._batch(batch_for_step(examples, step, 8, 0, True))
            group.optimizer_zero_grad()
            group.forward_backward(batch).get()
            group.optimizer_step(optim_step_params=values)
            step_time = time.perf_counter() - start
            f.write(json.dumps({"train/step": step, "time": time.time(), "perf/step_time_s": step_time}) + "\n")
    workers.shutdown()


def timed(cmd: list[str], metrics: Path) -> tuple[float, float, float]:
    """(median step time, start to the end of the first step, median time per step outside the verl calls).

    The last is paired within each step (the interval between finished steps less that step's
    perf/step_time_s), so load from other processes on the machine moves it far less than the step time."""
    start = time.time()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = [row["time"] for row in rows]
    outside = [b["time"] - a["time"] - b["perf/step_time_s"] for a, b in zip(rows, rows[1:])]
    return statistics.median(b - a for a, b in zip(times, times[1:])), times[0] - start, statistics.median(outside)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for the tinker_exp run")
    parser.add_argument("--bare-out")
    args = parser.parse_args()
    if args.bare_out:
        return bare_loop(args.steps, Path(args.bare_out))

    os.environ.setdefault("WANDB_MODE", "offline")
    with tempfile.TemporaryDirectory() as tmp:
        bare_metrics = Path(tmp) / "bare.jsonl"
        bare = timed([sys.executable, __file__, "--steps", str(args.steps), "--bare-out", str(bare_metrics)], bare_metrics)
        run_dir = Path(tmp) / "run"
        ours = timed(
            [sys.executable, "-m", "tinker_exp", "+override=constant", f"trainer.steps={args.steps}",
             f"hydra.run.dir={run_dir}", *args.set],
            run_dir / "metrics.jsonl",
        )
    print(f"{'':28}{'bare verl loop':>16}{'tinker_exp':>14}{'ratio':>8}")
    print(f"{'median step time (ms)':28}{bare[0] * 1e3:16.1f}{ours[0] * 1e3:14.1f}{ours[0] / bare[0]:8.3f}")
    print(f"{'  outside verl calls (ms)':28}{bare[2] * 1e3:16.2f}{ours[2] * 1e3:14.2f}{(ours[2] - bare[2]) * 1e3:+8.2f}")
    print(f"{'start to first step (s)':28}{bare[1]:16.2f}{ours[1]:14.2f}{ours[1] / bare[1]:8.3f}")
    settings = f"; {' '.join(args.set)}" if args.set else ""
    print(f"({args.steps} steps, 2 Ray CPU workers, batch 8, micro batch 2; tinker_exp with W&B offline + JSONL{settings})")


if __name__ == "__main__":
    main()
