"""The search methods of issue 57 against their baselines, through the real CLI; prints each run and the figures.

pb2: PB2 against PBT on the same budget (hparams_search=pbt_lr_cosine: population 4, the same steps, interval and
    space), one population of each per seed: the best member's final objective per seed, then per method the mean,
    the spread (sample standard deviation) and the best over seeds.
schedule-free: on the forecast corpus (docs/forecast.md; made with `python -m tinker_exp.forecast corpus` when
    --corpus is missing), optimizer=adamw_schedulefree at a constant lr with its own warmup, against AdamW with the
    best of WSD (decay fractions --wsd-decays) and cosine, all at the same length and peak lr, per seed: final
    val/loss per run, then per method the mean and spread over seeds ("best WSD" is the decay fraction with the
    lowest mean).

    .venv/bin/python benchmarks/search_methods.py pb2 [--seeds 0 1 2] [--steps 20] [--interval 5] [--set KEY=VALUE ...]
    .venv/bin/python benchmarks/search_methods.py schedule-free [--seeds 0 1 2] [--steps 200] [--lr 1e-3]
        [--warmup 0.05] [--wsd-decays 0.1 0.2 0.4] [--corpus outputs/corpus] [--set KEY=VALUE ...]

Long on 2 shared cores: every run is its own process with its own workers (a population: 4 members one at a time).
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


def cli(module: str, args: list[str]) -> str:
    """`python -m MODULE ARGS` in its own process; its output. Exits on failure."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{module} {' '.join(args)} failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"mean {statistics.mean(values):.4f}, sd {sd:.4f}, best {min(values):.4f}, n {len(values)}"


def pb2_against_pbt(args: argparse.Namespace, out: Path) -> None:
    from omegaconf import OmegaConf

    best: dict[str, list[float]] = {"perturb": [], "pb2": []}
    for seed in args.seeds:
        for explore in best:
            sweep = out / f"{explore}-{seed}"
            cli("tinker_exp", ["-m", "hparams_search=pbt_lr_cosine", f"hydra.sweeper.explore={explore}", f"hydra.sweeper.seed={seed}",
                               f"trainer.steps={args.steps}", f"hydra.sweeper.interval={args.interval}",
                               f"trainer.eval_every={args.interval}", "logger=none", f"hydra.sweep.dir={sweep}", *args.set])  # fmt: skip
            value = OmegaConf.load(sweep / "population_results.yaml").best_objective
            best[explore].append(float(value))
            print(f"seed {seed} {explore:7s}: best member's final objective {value:.4f}  ({sweep})", flush=True)
    for explore, values in best.items():
        print(f"{explore:7s}: {spread(values)}")


def final_val_loss(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["val/loss"] for row in rows if "val/loss" in row][-1]


def schedule_free_against_schedules(args: argparse.Namespace, out: Path) -> None:
    corpus = Path(args.corpus)
    if not (corpus / "corpus_train.jsonl").exists():
        cli("tinker_exp.forecast", ["corpus", str(corpus)])
    common = [f"data.path={corpus / 'corpus_train.jsonl'}", f"data.val_path={corpus / 'corpus_val.jsonl'}",
              f"trainer.steps={args.steps}", "trainer.eval_every=0", "logger=none", *args.set]  # fmt: skip
    methods = {
        "schedule-free": ["optimizer=adamw_schedulefree", f"optimizer.lr={args.lr}", "optimizer.weight_decay=0.01",
                          f"optimizer.warmup_steps={round(args.warmup * args.steps)}"],
        "cosine": ["+override=lr_cosine", f"optimizer.lr={args.lr}", f"override.lr.warmup_steps={args.warmup}"],
        **{f"wsd decay {d:g}": ["+override=lr_wsd", f"optimizer.lr={args.lr}", f"override.lr.warmup_steps={args.warmup}",
                                f"override.lr.decay_steps={d}"] for d in args.wsd_decays},
    }  # fmt: skip
    finals: dict[str, list[float]] = {name: [] for name in methods}
    for seed in args.seeds:
        for name, overrides in methods.items():
            run_dir = out / f"{name.replace(' ', '_')}-{seed}"
            cli("tinker_exp", [*common, *overrides, f"trainer.seed={seed}", f"hydra.run.dir={run_dir}"])
            finals[name].append(final_val_loss(run_dir))
            print(f"seed {seed} {name:16s}: final val/loss {finals[name][-1]:.4f}", flush=True)
    best_wsd = min((name for name in finals if name.startswith("wsd")), key=lambda name: statistics.mean(finals[name]))
    for name in ("schedule-free", "cosine", best_wsd):
        print(f"{name:16s}: {spread(finals[name])}" + ("  (the best WSD)" if name == best_wsd else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    pb2 = sub.add_parser("pb2")
    pb2.add_argument("--steps", type=int, default=20)
    pb2.add_argument("--interval", type=int, default=5)
    free = sub.add_parser("schedule-free")
    free.add_argument("--steps", type=int, default=200)
    free.add_argument("--lr", type=float, default=1e-3)
    free.add_argument("--warmup", type=float, default=0.05, help="a fraction of the run, for every method")
    free.add_argument("--wsd-decays", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    free.add_argument("--corpus", default=str(REPO / "outputs" / "corpus"))
    for each in (pb2, free):
        each.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
        each.add_argument("--set", nargs="*", default=[], help="more overrides for every run")
        each.add_argument("--keep", help="a folder for the runs (default: a temporary one, removed)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep or tmp)
        (pb2_against_pbt if args.what == "pb2" else schedule_free_against_schedules)(args, out)


if __name__ == "__main__":
    main()
