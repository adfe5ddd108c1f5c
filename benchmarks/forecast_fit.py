"""How long does `python -m tinker_exp.forecast fit` take on pretraining-length curves, and does the fast fit find
today's parameters? The speed figure of docs/forecast.md.

Three curves generated from the multi-power law (normalised-lr parameters L0 3, A 42, alpha 0.44, B 0.4, C 0.01,
beta 0.6, gamma 0.6) with log-normal noise (0.5 %) on every logged loss, the shapes of the published fitting set:
constant, cosine to 0.1 x peak, and a two-stage constant (0.1 x peak from 2/3 of the run), each --steps long with a
warmup of 9 % and the loss logged every --every steps, written as metrics.jsonl files. Runs `python -m
tinker_exp.forecast fit` on them in this process (mpl law, train/loss, --refits refits; law.json and fit.png into a
temporary dir) and prints its time and the fitted parameters. With --old, also the fit of --old-rev (the code before the fast
fit: finite-difference Jacobian, a dense [point, change point] matrix) without refits, and the fast fit without
refits beside it: the largest relative difference of their parameters. --old's fit is timed without its
errors_of (a dense matrix over every logged point: GBs at 24,000 steps), so its figure is a lower bound.

    .venv/bin/python benchmarks/forecast_fit.py [--steps 24000] [--every 10] [--refits 16] [--old] [--old-rev 90e65c2]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tinker_exp.forecast.__main__ import main as forecast_main
from tinker_exp.forecast.fit import fit_law, read_law
from tinker_exp.forecast.laws import LAWS, predict
from tinker_exp.forecast.runs import Curve

REPO = Path(__file__).resolve().parent.parent

TRUE = np.array([3.0, 42.0, 0.44, 0.4, 0.01, 0.6, 0.6])
PEAK = 3e-4


def schedules(steps: int) -> dict[str, np.ndarray]:
    warm = int(0.09 * steps)
    base = np.ones(steps)
    base[:warm] = np.arange(warm) / warm
    cosine, two_stage = base.copy(), base.copy()
    progress = (np.arange(warm, steps) - warm) / (steps - warm)
    cosine[warm:] = 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * progress))
    two_stage[2 * steps // 3 :] = 0.1
    return {"constant": base, "cosine": cosine, "two_stage": two_stage}


def curves(steps: int, every: int, noise: float = 0.005, seed: int = 0) -> list[Curve]:
    rng = np.random.default_rng(seed)
    made = []
    for name, lr in schedules(steps).items():
        at = np.arange(every, steps, every)
        loss = predict(LAWS["mpl"], TRUE, lr, at) * np.exp(rng.normal(0, noise, len(at)))
        made.append(Curve(name, Path(name), PEAK * lr, at, loss, [name] * len(at)))
    return made


def write_metrics(path: Path, curve: Curve) -> Path:
    """The curve as a run's metrics.jsonl: applied/lr at every step, train/loss where logged."""
    loss = dict(zip(curve.steps.tolist(), curve.loss.tolist()))
    rows = ({"train/step": s, "applied/lr": float(v), **({"train/loss": loss[s]} if s in loss else {})} for s, v in enumerate(curve.lr))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def old_fit(rev: str):
    """fit_law of `rev`: its laws.py and fit.py imported from git as a package of their own (runs.py is today's:
    the names the old fit imports from it are unchanged)."""
    tmp = Path(tempfile.mkdtemp()) / "old_forecast"
    tmp.mkdir()
    for name in ("laws", "fit"):
        text = subprocess.run(["git", "show", f"{rev}:tinker_exp/forecast/{name}.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        (tmp / f"{name}.py").write_text(text.replace("tinker_exp.forecast.laws", "old_forecast.laws"))
    (tmp / "__init__.py").write_text("")
    sys.path.insert(0, str(tmp.parent))
    import old_forecast.fit as module  # noqa: F401  (the package on sys.path now)

    module.errors_of = lambda law, curve: {"final_error": 0.0}  # see the module's docstring
    return module.fit_law


def shown(params: np.ndarray) -> str:
    return ", ".join(f"{n}={v:.6g}" for n, v in zip(LAWS["mpl"].params, params))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24_000)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--refits", type=int, default=16)
    p.add_argument("--old", action="store_true", help="also time the fit of --old-rev (minutes) and compare parameters")
    p.add_argument("--old-rev", default="90e65c2")
    args = p.parse_args()
    made = curves(args.steps, args.every)
    print(f"3 curves of {args.steps} steps (constant, cosine, two-stage), {len(made[0].steps)} logged points each; true: {shown(TRUE)}", flush=True)
    work = Path(tempfile.mkdtemp())
    files = [str(write_metrics(work / f"{c.name}.jsonl", c)) for c in made]
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the command's own table: the figures below are what matter
        forecast_main(["fit", *files, "--refits", str(args.refits), "--out", str(work / "law")])
    took = time.perf_counter() - start
    law = read_law(work / "law" / "law.json")
    fit = law.record["fit"]
    print(f"python -m tinker_exp.forecast fit (law.json and fit.png), {args.refits} refits: {took:.1f} s; "
          f"{fit['refits']} refits converged, {fit['refits_not_converged']} did not", flush=True)  # fmt: skip
    print(f"  {shown(law.params)}", flush=True)
    if not args.old:
        return
    start = time.perf_counter()
    fast = fit_law("mpl", made, "train/loss", refits=0)
    fast_took = time.perf_counter() - start
    start = time.perf_counter()
    old = old_fit(args.old_rev)("mpl", made, "train/loss", refits=0)
    old_took = time.perf_counter() - start
    print(f"fast fit, no refits: {fast_took:.1f} s\n  {shown(fast.params)}")
    print(f"{args.old_rev} fit, no refits: {old_took:.1f} s (without its errors_of)\n  {shown(old.params)}")
    print(f"largest relative parameter difference: {np.max(np.abs(fast.params - old.params) / np.abs(old.params)):.2e}; "
          f"cost {fast.record['fit']['cost']:.6g} (fast) vs {old.record['fit']['cost']:.6g} ({args.old_rev})")  # fmt: skip


if __name__ == "__main__":
    main()
