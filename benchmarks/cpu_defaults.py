"""The CPU defaults against the settings before them: a step of the default run (the tiny Llama, 2 workers, 8 x 128
tokens), paired runs of benchmarks/gpu.py's loop, medians.

Each pair runs, in turn, the settings before (backend.reshard_after_forward=true, backend.optimizer_kernel=for_loop)
and today's defaults (parameters kept gathered to the backward, foreach where it is exact: docs/devices.md). Printed:
every pair's median step and its split, the ratio after / before per pair and their median, whether every run's
losses are bitwise those of the first, and the load average (`uptime`'s 1-minute figure) at each run's start and end.

    .venv/bin/python benchmarks/cpu_defaults.py [--pairs 3] [--steps 40] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEFORE = ["--set", "backend.reshard_after_forward=true", "--set", "backend.optimizer_kernel=for_loop"]
"""The CPU defaults before this change, asked for explicitly."""


def one_run(settings: list[str], args: argparse.Namespace, figures: Path) -> dict:
    load = os.getloadavg()[0]
    command = [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--tiny", "--device", "cpu", "--no-bare",
               "--steps", str(args.steps), "--warmup", "2", "--seq", "128", "--rows", "8", "--set", "model.path=null",
               "--set", "backend.num_workers=2", *settings, *[x for kv in args.set for x in ("--set", kv)],
               "--json", str(figures)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, "TINKER_EXP_POOL": "none"})
    if done.returncode != 0:
        sys.exit(f"benchmarks/gpu.py failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    result = json.loads(figures.read_text())["tinker_exp"]
    return {**result, "load": (load, os.getloadavg()[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="steps a run (2 warm-up steps left out of its median)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for both settings")
    args = parser.parse_args()
    ratios, runs = [], []
    with tempfile.TemporaryDirectory(prefix="cpu-defaults-") as tmp:
        for pair in range(args.pairs):
            before = one_run(BEFORE, args, Path(tmp) / f"before{pair}.json")
            after = one_run([], args, Path(tmp) / f"after{pair}.json")
            runs += [before, after]
            ratios.append(after["step_s"] / before["step_s"])
            for name, run in (("before", before), ("defaults", after)):
                print(f"pair {pair + 1} {name:>8}: step {run['step_s'] * 1e3:6.1f} ms (forward_backward "
                      f"{run['worker_forward_backward_s'] * 1e3:.1f} ms in the worker, optimizer_step "
                      f"{run['worker_optimizer_step_s'] * 1e3:.1f} ms); load {run['load'][0]:.2f} -> {run['load'][1]:.2f}")
            print(f"pair {pair + 1}: defaults / before = {ratios[-1]:.3f}", flush=True)
    same = all(run["losses"] == runs[0]["losses"] for run in runs)
    print(f"median step: before {statistics.median(r['step_s'] for r in runs[::2]) * 1e3:.1f} ms, defaults "
          f"{statistics.median(r['step_s'] for r in runs[1::2]) * 1e3:.1f} ms; median of the per-pair ratios "
          f"{statistics.median(ratios):.3f} ({', '.join(f'{r:.3f}' for r in ratios)})")
    print(f"losses of all {len(runs)} runs ({args.steps} steps each): {'bitwise equal' if same else 'DIFFER'}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
