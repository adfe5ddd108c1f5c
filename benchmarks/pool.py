"""Warm workers (tinker_exp/pool/) against cold starts: paired runs, medians, ratios. Six parts, each its own command:

- start: process start to the end of step 1, for the bare verl loop (benchmarks/overhead.py's), a cold run
  (backend.pool=none) and a run on a warm pool (started once, before the pairs); each pair runs the three in an
  alternating order. Printed: every pair, the medians and ratios, and the warm run's parts: the client's (Python,
  Hydra, the checks, until its log says it handed the run over), the pool's (inputs, fresh state, sinks) and step 1.
- study: an Optuna study (hparams_search=lr_cosine, seeded) of --trials trials of --steps steps, cold then warm
  (the sweep's own pool): wall time against the sum of its trials' training time (first step's start to last row),
  and whether both studies found the same objective values and best trial.
- slots: an Optuna study of --trials LoRA trials (lora=r8) cold, warm (one trial at a time on the sweep's pool) and
  packed (hydra.launcher.slots=--trials: every trial on a slot of one group, docs/slots.md), --pairs times in a
  rotating order: wall medians, ratios, trials per hour, and the same objective values on every side.
- pool-slots: the same study on a warm pool of --trials slots, up before (`pool up --slots`): one trial at a time
  (a process a trial, each leasing the pool) against packed (hydra.launcher.slots: every trial a thread of the sweep
  on a slot of the pool's group), --pairs times in alternating order.
- pbt: a population (hparams_search=pbt_lr_cosine, 4 members), cold then warm: wall time.
- memory: a pool's resident memory (its process and all below it: Ray's daemons, the workers) at rest, then after
  and during each of --runs short runs on it, each with its own seed (a rebuild of the engine each); the growth
  (first vs last, the least-squares slope) and the peak. --one-seed: every run seed 0 (the kept state restored).

    .venv/bin/python benchmarks/pool.py start [--pairs 3] [--steps 3] [--no-bare] [--set KEY=VALUE ...]
    .venv/bin/python benchmarks/pool.py study [--trials 8] [--steps 20] [--no-cold]
    .venv/bin/python benchmarks/pool.py slots [--trials 8] [--steps 20] [--pairs 1] [--no-cold]
    .venv/bin/python benchmarks/pool.py pool-slots [--trials 8] [--steps 20] [--pairs 3]
    .venv/bin/python benchmarks/pool.py pbt
    .venv/bin/python benchmarks/pool.py memory [--runs 50] [--one-seed]
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
sys.path.insert(0, str(REPO / "benchmarks"))

from overhead import figures, prepare, spread, timed  # noqa: E402  (the bare loop and its timing, as overhead.py has them)

PYTHON = sys.executable


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def handed_over(log: Path) -> float:
    """When the client handed its run to the pool: its log line saying so (the run dir's log, ms resolution)."""
    from datetime import datetime

    line = next(l for l in log.read_text().splitlines() if "pool: training on the warm workers" in l)
    return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def pool_command(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([PYTHON, "-m", "tinker_exp.pool", *args], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"pool {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return done


def start(args: argparse.Namespace, tmp: Path) -> None:
    overrides = ["+override=constant", f"trainer.steps={args.steps}", "checkpoint.every_steps=0", "checkpoint.at_end=false", *args.set]
    if not args.no_bare:
        (tmp / "spec.json").write_text(json.dumps(prepare(overrides, tmp)[0]))
    print(pool_command("up", *overrides).stdout.strip().splitlines()[-1], file=sys.stderr)
    starts: dict[str, list[float]] = {"bare": [], "cold": [], "warm": []}
    parts, losses = [], {}
    sides = ["cold", "warm"] if args.no_bare else ["bare", "cold", "warm"]
    try:
        for pair in range(args.pairs):
            order = sides[pair % len(sides):] + sides[:pair % len(sides)]
            for side in order:
                if side == "bare":
                    out = tmp / f"bare_{pair}.jsonl"
                    began, rows = timed([PYTHON, str(REPO / "benchmarks" / "overhead.py"), "--bare", str(tmp / "spec.json"), str(out)],
                                        lambda: [json.loads(line) for line in out.read_text().splitlines()][:-1])  # fmt: skip
                    starts["bare"].append(figures(began, [r["time"] for r in rows])[1])
                    losses["bare"] = [r["loss"] for r in rows]
                    continue
                run_dir = tmp / f"{side}_{pair}"
                pool = ["backend.pool=none"] if side == "cold" else []
                began, rows = timed([PYTHON, "-m", "tinker_exp", *overrides, *pool, f"hydra.run.dir={run_dir}"], lambda: rows_of(run_dir))
                starts[side].append(rows[0]["time"] - began)
                losses[side] = [r["train/loss"] for r in rows]
                if side == "warm":  # its parts: the client's until it hands the run over, the pool's, step 1
                    sent = handed_over(run_dir / "tinker_exp.log")
                    step = rows[0]["perf/step_time_s"]
                    parts.append((sent - began, rows[0]["time"] - step - sent, step))
            print(f"pair {pair + 1}/{args.pairs}: " + ", ".join(f"{s} {starts[s][-1]:.2f} s" for s in sides), file=sys.stderr)
    finally:
        pool_command("down")
    print(f"{'pair':6}" + "".join(f"{side + ' s':>9}" for side in ("bare", "cold", "warm") if starts[side]) + f"{'warm/cold':>11}"
          + ("" if args.no_bare else f"{'warm/bare':>11}"))  # fmt: skip
    for i in range(args.pairs):
        c, w = starts["cold"][i], starts["warm"][i]
        print(f"{i + 1:<6}" + (f"{starts['bare'][i]:9.2f}" if starts["bare"] else "") + f"{c:9.2f}{w:9.2f}{w / c:11.3f}"
              + ("" if args.no_bare else f"{w / starts['bare'][i]:11.3f}"))  # fmt: skip
    med = {side: statistics.median(values) for side, values in starts.items() if values}
    print(f"process start to the end of step 1 (median (min..max)): " + ", ".join(f"{side} {spread(starts[side], '.2f')} s" for side in sides)
          + f"; warm/cold {med['warm'] / med['cold']:.3f}" + ("" if args.no_bare else f", warm/bare {med['warm'] / med['bare']:.3f}"))  # fmt: skip
    client, pool, step = (statistics.median(p[i] for p in parts) for i in range(3))
    print(f"the warm run's parts (medians): the client (Python, Hydra, checks, the pool's lease) {client:.2f} s; the pool "
          f"(the run's inputs, fresh state, sinks) {pool:.2f} s; step 1 itself {step:.2f} s")  # fmt: skip
    print(f"losses: cold == warm {'bitwise' if losses['cold'] == losses['warm'] else 'DIFFER'}"
          + ("" if args.no_bare else f"; bare == warm {'bitwise' if losses['bare'] == losses['warm'] else 'differ'}"))


def sweep(command: list[str], sweep_dir: Path) -> tuple[float, list[dict]]:
    """Run a sweep; (its wall time, each job's rows) (jobs in sweep_dir/N/)."""
    began = time.monotonic()
    done = subprocess.run([PYTHON, "-m", "tinker_exp", *command, f"hydra.sweep.dir={sweep_dir}"], cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - began
    if done.returncode != 0:
        sys.exit(f"the sweep failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    jobs = sorted((p for p in sweep_dir.iterdir() if p.name.isdigit() and (p / "metrics.jsonl").exists()), key=lambda p: int(p.name))
    return wall, [{"num": int(j.name), "rows": rows_of(j), "objective": objective(j)} for j in jobs]


def objective(run_dir: Path) -> float | None:
    path = run_dir / "objective.json"
    return json.loads(path.read_text()).get("value") if path.exists() else None


def training_time(rows: list[dict]) -> float:
    """A run's training: from its first step's start to its last row."""
    return rows[-1]["time"] - rows[0]["time"] + rows[0]["perf/step_time_s"]


def training_span(runs: list[list[dict]]) -> float:
    """Trials' training as the study spends it, overlaps counted once: from the first step's start of any of them to
    the last row of any."""
    return max(rows[-1]["time"] for rows in runs) - min(rows[0]["time"] - rows[0]["perf/step_time_s"] for rows in runs)


def compare_sweeps(name: str, command: list[str], tmp: Path, cold: bool = True) -> None:
    results = {}
    for side, extra in (("cold", ["backend.pool=none"]), ("warm", [])) if cold else (("warm", []),):
        wall, jobs = sweep([*command, *extra], tmp / side)
        trained = sum(training_time(job["rows"]) for job in jobs)
        results[side] = (wall, trained, jobs)
        print(f"{name} {side}: {len(jobs)} jobs, wall {wall:.1f} s, their training {trained:.1f} s: ratio {wall / trained:.2f}", file=sys.stderr)
    if not cold:
        ww, wt, _ = results["warm"]
        print(f"{name}: wall warm {ww:.1f} s; wall / the trials' training {ww / wt:.2f}x")
        return
    (cw, ct, cj), (ww, wt, wj) = results["cold"], results["warm"]
    print(f"{name}: wall cold {cw:.1f} s, warm {ww:.1f} s (warm/cold {ww / cw:.3f}); wall / the trials' training: cold "
          f"{cw / ct:.2f}x, warm {ww / wt:.2f}x")  # fmt: skip
    same = [a["objective"] for a in cj] == [b["objective"] for b in wj]
    best = lambda jobs: min((j for j in jobs if j["objective"] is not None), key=lambda j: j["objective"])["num"]  # noqa: E731
    print(f"{name}: objective values cold == warm: {same}; best job cold {best(cj)}, warm {best(wj)}")


def study(args: argparse.Namespace, tmp: Path) -> None:
    compare_sweeps("study", ["-m", "hparams_search=lr_cosine", f"hydra.sweeper.n_trials={args.trials}",
                             f"trainer.steps={args.steps}", "logger=none"], tmp, cold=not args.no_cold)  # fmt: skip


LORA_STUDY = ["-m", "hparams_search=lr_cosine", "logger=none", "lora=r8"]
"""The study both slots parts run (lr_cosine, seeded), with --trials and --steps."""


def slots(args: argparse.Namespace, tmp: Path) -> None:
    """An Optuna study of LoRA trials (lr_cosine, seeded) three ways, each --pairs times in a rotating order: cold
    (a process and a group a trial), warm (the sweep's pool, one trial at a time) and packed (hydra.launcher.slots
    = --trials: every trial a thread on a slot of one group). Wall medians, ratios, trials per hour; whether every
    side found the same objective values, trial by trial, and the same best trial."""
    one_a_process = "hydra.launcher.slots=1"  # LoRA trials train on slots by default (auto)
    sides = {"cold": ["backend.pool=none", one_a_process], "warm": [one_a_process], "packed": [f"hydra.launcher.slots={args.trials}"]}
    if args.no_cold:
        del sides["cold"]
    compare_studies(args, tmp, sides, "packed")


def pool_slots(args: argparse.Namespace, tmp: Path) -> None:
    """The same study on a warm pool of --trials slots, up before (the user's: `pool up --slots N lora=r8`): one trial
    at a time (a process a trial, each leasing the pool) against packed (hydra.launcher.slots=--trials: every trial a
    thread of the sweep's process on a slot of the pool's group), --pairs times in alternating order."""
    from tinker_exp.place import wire

    pool_command("up", f"--slots={args.trials}", "lora=r8", "logger=none")
    address = wire.address_of()
    try:
        at = f"backend.pool={address}"
        sides = {"one at a time": [at, "hydra.launcher.slots=1"], "packed": [at, f"hydra.launcher.slots={args.trials}"]}  # 1: not auto's slots
        compare_studies(args, tmp, sides, "packed")
    finally:
        pool_command("down")


def compare_studies(args: argparse.Namespace, tmp: Path, sides: dict[str, list[str]], packed: str) -> None:
    """Each side's study --pairs times in a rotating order: wall medians, trials per hour, each side's ratio to the
    `packed` one, and whether every side found the same objective values, trial by trial, and the same best trial."""
    command = [*LORA_STUDY, f"hydra.sweeper.n_trials={args.trials}", f"trainer.steps={args.steps}"]
    walls: dict[str, list[float]] = {side: [] for side in sides}
    spans: dict[str, list[float]] = {side: [] for side in sides}
    found: dict[str, list] = {}
    for pair in range(args.pairs):
        order = list(sides)[pair % len(sides):] + list(sides)[: pair % len(sides)]
        for side in order:
            wall, jobs = sweep([*command, *sides[side]], tmp / f"{side.replace(' ', '_')}{pair}")
            walls[side].append(wall)
            trained = sum(training_time(job["rows"]) for job in jobs)
            span = training_span([job["rows"] for job in jobs])
            spans[side].append(wall / span)
            found.setdefault(side, [j["objective"] for j in jobs])
            print(f"pair {pair} {side}: wall {wall:.1f} s, its trials' training {trained:.1f} s summed, {span:.1f} s from the "
                  f"first step's start to the last row (wall / that {wall / span:.2f})", file=sys.stderr)  # fmt: skip
    median = {side: statistics.median(w) for side, w in walls.items()}
    for side, wall in median.items():
        print(f"{side}: wall {spread(walls[side], '.1f')} s; {args.trials * 3600 / wall:.0f} trials per hour; wall over "
              f"the span of its trials' training {spread(spans[side], '.2f')}")  # fmt: skip
    for side in (s for s in median if s != packed):
        print(f"{packed}/{side}: {median[packed] / median[side]:.3f}")
    best = {side: min(range(len(v)), key=lambda i: float("inf") if v[i] is None else v[i]) for side, v in found.items()}
    same = all(v == found[packed] for v in found.values())
    # packed steps are within a bound of the steps alone, not bitwise (docs/slots.md#how-a-slot-trains)
    apart = max((abs(a - b) / abs(b) for v in found.values() for a, b in zip(found[packed], v) if a is not None and b), default=0.0)
    print(f"objective values the same on every side, trial by trial: {same} (largest relative difference, {packed} "
          f"against each side: {apart:.1e}); best trial: {best}")  # fmt: skip


def pbt(args: argparse.Namespace, tmp: Path) -> None:
    compare_sweeps("pbt", ["-m", "hparams_search=pbt_lr_cosine", "logger=none"], tmp)


def tree_memory(pid: int) -> dict[str, float]:
    """The resident memory (MiB, /proc) of a pool's process and everything below it (Ray's daemons, the workers):
    `rss` now, summed; `hwm` each process's peak since its last reset (`reset_peaks`), summed (a bound on the tree's
    peak: the processes' peaks need not fall at one moment)."""
    from tinker_exp.pool.host import descendant_pids

    total = {"rss": 0.0, "hwm": 0.0}
    for each in [pid, *descendant_pids(pid)]:
        try:
            for line in Path(f"/proc/{each}/status").read_text().splitlines():
                if line.startswith(("VmRSS:", "VmHWM:")):
                    total["rss" if line.startswith("VmRSS") else "hwm"] += int(line.split()[1]) / 1024
        except OSError:  # ended meanwhile
            pass
    return total


def reset_peaks(pid: int) -> None:
    """Each process's peak resident memory (VmHWM) set back to its current (Linux: clear_refs 5)."""
    from tinker_exp.pool.host import descendant_pids

    for each in [pid, *descendant_pids(pid)]:
        try:
            Path(f"/proc/{each}/clear_refs").write_text("5")
        except OSError:
            pass


def slope(values: list[float]) -> float:
    """Least squares MiB a run."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(values)
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / sum((x - mean_x) ** 2 for x in range(n))


def memory(args: argparse.Namespace, tmp: Path) -> None:
    """--runs short runs, each with its own seed (trainer.seed=N: each rebuilds the engine from the model dir, the
    costliest start a kept group has): the pool's tree's memory after each, and its peak during each (sampled every
    50 ms, and each process's own peak)."""
    import threading

    from tinker_exp.place import wire

    overrides = ["trainer.steps=2", "checkpoint.every_steps=0", "checkpoint.at_end=false", "logger=none"]
    pool_command("up", *overrides)
    status = wire.ask(wire.address_of(), ("status",))
    pid = status["pid"]
    print(f"at rest: the tree {tree_memory(pid)['rss']:.0f} MiB; pool {status['memory_mb']['pool']:.0f}, "
          f"workers {', '.join(f'{mb:.0f}' for mb in status['memory_mb']['workers'])}")  # fmt: skip
    after, peaks, bounds = [], [], []
    try:
        for run in range(1, args.runs + 1):
            reset_peaks(pid)
            done, sampled = threading.Event(), [0.0]

            def sample() -> None:
                while not done.wait(0.05):
                    sampled[0] = max(sampled[0], tree_memory(pid)["rss"])

            sampler = threading.Thread(target=sample)
            sampler.start()
            try:
                done_run = subprocess.run([PYTHON, "-m", "tinker_exp", *overrides, f"trainer.seed={0 if args.one_seed else run}", f"hydra.run.dir={tmp / f'run_{run}'}"],
                                          cwd=REPO, capture_output=True, text=True, check=True)  # fmt: skip
                if "pool: training on the warm workers" not in done_run.stdout:  # a stale or ended pool: a cold run
                    sys.exit(f"run {run} did not train on the pool:\n{done_run.stdout[-2000:]}")
            finally:
                done.set()
                sampler.join()
            now = tree_memory(pid)
            status = wire.ask(wire.address_of(), ("status",))
            after.append(now["rss"]), peaks.append(sampled[0]), bounds.append(now["hwm"])
            print(f"run {run} (seed {0 if args.one_seed else run}): the tree {now['rss']:.0f} MiB after, peak {sampled[0]:.0f} (sampled; per-process "
                  f"peaks summed {now['hwm']:.0f}); pool {status['memory_mb']['pool']:.0f}, workers "
                  f"{', '.join(f'{mb:.0f}' for mb in status['memory_mb']['workers'])}", flush=True)  # fmt: skip
    finally:
        pool_command("down")
    half = after[len(after) // 2 :]
    print(f"the pool's tree over {len(after)} runs, {'all seed 0' if args.one_seed else 'each its own seed'} (MiB): after run 1 {after[0]:.0f}, after run {len(after)} "
          f"{after[-1]:.0f} (+{after[-1] - after[0]:.0f}); slope {slope(after):+.2f} MiB a run over all, {slope(half):+.2f} over the "
          f"last {len(half)}; peak during a run: max {max(peaks):.0f} (sampled), {max(bounds):.0f} (per-process peaks summed)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["start", "study", "slots", "pool-slots", "pbt", "memory"])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--one-seed", action="store_true", help="memory: every run seed 0 (the kept state restored, no rebuild)")
    parser.add_argument("--no-bare", action="store_true", help="start: without the bare verl loop")
    parser.add_argument("--no-cold", action="store_true", help="study: warm only; slots: warm and packed only")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="start: a config override (a GPU: backend.num_workers=1)")
    args = parser.parse_args()
    args.steps = args.steps or (3 if args.part == "start" else 20)
    os.environ.setdefault("WANDB_MODE", "offline")
    with tempfile.TemporaryDirectory() as name:
        parts = {"start": start, "study": study, "slots": slots, "pool-slots": pool_slots, "pbt": pbt, "memory": memory}
        parts[args.part](args, Path(name))


if __name__ == "__main__":
    main()
