"""How well does a loss-curve law forecast schedules of the tiny model? The measurement of docs/forecast.md.

Data that does not repeat within a run (the regime the laws describe; the shipped 256-row set is seen ~6 times in
200 steps and is not): the generated SFT corpus of distinct rows of `python -m tinker_exp.forecast corpus`
(tinker_exp/forecast/corpus.py), written under OUT, with a held-out file for val/loss. Runs (all `python -m tinker_exp`, lr peak 1e-3,
warmup 20 steps, horizon T):
- fitted: a constant trunk (WSD with no decay, checkpoints every T/10), WSD decay branches off it: 20 % 1-sqrt to 0
  (fit A: trunk + it), and 40 % linear to 0 (fit B: trunk + both);
- held out: cosine (`--seeds`, default 2: the seed-to-seed spread), WSD 10 % (a branch), the 40 % linear decay
  (held out by fit A), and a longer horizon (WSD over 1.5 T, 20 % 1-sqrt, a branch off the trunk's last checkpoint);
- the proposed WSD schedule of fit A, run from its override file as is.
Then per fit and metric: `check` on the held-out runs, Kendall's tau of predicted against measured final loss over
the T-step schedules, and the regret of the proposed schedule against the best measured one. Prints the table (and
writes OUT/table.md). A run already finished in OUT is not run again.

    .venv/bin/python benchmarks/forecast.py [--out outputs/forecast_bench] [--steps 300] [--law mpl] [--from-step 60] [--seeds 2] [--runs-only]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tinker_exp.forecast.corpus import write_corpus

REPO = Path(__file__).resolve().parent.parent


def run(name: str, out: Path, args: list[str], env: dict[str, str]) -> Path:
    run_dir = out / "runs" / name
    if (run_dir / "objective.json").is_file():
        return run_dir
    start = time.time()
    result = subprocess.run([sys.executable, "-m", "tinker_exp", *args, f"hydra.run.dir={run_dir}", "logger=none"],
                            cwd=REPO, env=env, capture_output=True, text=True)  # fmt: skip
    if result.returncode != 0:
        sys.exit(f"{name} failed ({result.returncode}): {result.stderr[-3000:]}")
    print(f"  ran {name} in {time.time() - start:.0f} s", flush=True)
    return run_dir


def forecast(*args: str, refusal_ok: bool = False) -> str:
    result = subprocess.run([sys.executable, "-m", "tinker_exp.forecast", *args], cwd=REPO, capture_output=True, text=True)
    if result.returncode == 2 and refusal_ok:
        return "refused: " + result.stderr.strip()
    if result.returncode != 0:
        sys.exit(f"forecast {args[0]} failed: {result.stderr[-3000:]}")
    return result.stdout


def final_of(run_dir: Path, metric: str, window: int) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    values = [r[metric] for r in rows if metric in r]
    return float(np.mean(values[-window:]))


def read_law(path: Path):
    from tinker_exp.forecast.fit import read_law as read

    return read(path)


def kendall_tau(a: list[float], b: list[float]) -> float:
    from scipy.stats import kendalltau

    return float(kendalltau(a, b).statistic)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="outputs/forecast_bench")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--law", default="mpl")
    p.add_argument("--seeds", type=int, default=2, help="cosine runs with seeds 0.. (the seed-to-seed spread)")
    p.add_argument("--runs-only", action="store_true", help="run (or find) the runs, fit nothing")
    p.add_argument("--from-step", type=int, default=60, help="fit from this step: the tiny model's first fast drop (loss 6 -> 3.5) is not the law's regime")
    args = p.parse_args()
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    T, warm = args.steps, 20
    long_T = T * 3 // 2
    train, val = write_corpus(out, train_rows=long_T * 8 + 200, val_rows=160)
    env = {**os.environ, "WANDB_MODE": "offline"}
    if "RAY_ADDRESS" not in env:  # one Ray for every run: each run's own start-up is most of a short run's time
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # the runs join it without a token, as the tests' runs do
        ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
        env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    common = [f"data.path={train}", f"data.val_path={val}", "trainer.eval_every=20", "optimizer.lr=1e-3"]
    quiet = ["checkpoint.every_steps=0", "checkpoint.keep_last=1"]
    wsd = lambda steps, decay, shape: ["+override=lr_wsd", f"override.lr.warmup_steps={warm}", f"override.lr.decay_steps={decay}",  # noqa: E731
                                       f"override.lr.decay_shape={shape}", "override.lr.min_ratio=0.0", f"trainer.steps={steps}"]  # fmt: skip
    every = T // 10
    print(f"runs under {out / 'runs'} (T={T}, the longer horizon {long_T}):", flush=True)
    trunk = run("constant", out, [*common, *wsd(T, 0, "linear"), f"checkpoint.every_steps={every}", f"checkpoint.keep_every={every}"], env)
    branch = lambda at: [f"branch.from={trunk}", f"branch.step={at}", *quiet]  # noqa: E731
    runs = {
        "constant": trunk,
        "wsd20": run("wsd20", out, [*common, *wsd(T, T // 5, "1-sqrt"), *branch(T - T // 5)], env),
        "wsd40_linear": run("wsd40_linear", out, [*common, *wsd(T, 2 * T // 5, "linear"), *branch(T - 2 * T // 5)], env),
        "wsd10": run("wsd10", out, [*common, *wsd(T, T // 10, "1-sqrt"), *branch(T - T // 10)], env),
        "cosine": run("cosine", out, [*common, *quiet, "+override=lr_cosine", f"override.lr.warmup_steps={warm}", f"trainer.steps={T}"], env),
        f"wsd20_long{long_T}": run(f"wsd20_long{long_T}", out, [*common, *wsd(long_T, long_T // 5, "1-sqrt"), *branch(T)], env),
    }
    seeds = [runs["cosine"]] + [run(f"cosine_seed{s}", out, [*common, *quiet, "+override=lr_cosine", f"override.lr.warmup_steps={warm}",
                                                               f"trainer.steps={T}", f"trainer.seed={s}"], env) for s in range(1, args.seeds)]  # fmt: skip
    if args.runs_only:
        return

    def run_proposed(law_dir: Path) -> Path:
        """The proposal run as written; named by its lr schedule, so that another proposal is run, not found."""
        text = (law_dir / "override" / "proposed.yaml").read_text()
        digest = hashlib.sha256(text[text.index("override:") :].encode()).hexdigest()[:8]
        return run(f"proposed_{digest}", out, ["--config-dir", str(law_dir), "+override=proposed", *quiet], env)

    table = measure(out, runs, seeds, T, warm, args.law, args.from_step, run_proposed)
    (out / "table.md").write_text(table + "\n")
    print(table)


def measure(out: Path, runs: dict[str, Path], seeds: list[Path], T: int, warm: int, law_name: str, from_step: int, run_proposed) -> str:
    """Fits A and B per metric, their checks, Kendall's tau and the proposed schedule's regret: the table."""
    fits = {"A": ["constant", "wsd20"], "B": ["constant", "wsd20", "wsd40_linear"]}
    lines = [f"# Forecast on the tiny model: T={T}, warmup {warm}, peak lr 1e-3, {law_name} law fitted from step {from_step}", ""]
    proposed, proposed_line = out, ""
    for metric, window in (("train/loss", 10), ("val/loss", 1)):
        spread = [final_of(d, metric, window) for d in seeds]
        lines += [f"## {metric} (final: mean of the last {window} logged)", "",
                  f"seed-to-seed spread of cosine ({len(seeds)} seeds): max - min {max(spread) - min(spread):.4f}, std {np.std(spread, ddof=1):.4f}", ""]  # fmt: skip
        for fit_name, fitted in fits.items():
            law_dir = out / f"fit_{fit_name}_{metric.split('/')[0]}"
            forecast("fit", *(str(runs[n]) for n in fitted), "--law", law_name, "--metric", metric, "--out", str(law_dir), "--from-step", str(from_step), "--overwrite")
            held = [n for n in runs if n not in fitted]
            forecast("check", str(law_dir / "law.json"), *[str(runs[n]) for n in held], *[str(s) for s in seeds[1:]])
            checked = json.loads((law_dir / "check.json").read_text())["runs"]
            lines += [f"### fit {fit_name}: {' + '.join(fitted)}", "", "| held-out run | actual | predicted | final error | mean rel | worst rel |", "|---|---|---|---|---|---|"]
            lines += [f"| {r['run'].split('/')[-1]} | {r['actual']:.4f} | {r['predicted']:.4f} | {r['final_error']:+.4f} | {100 * r['mean_rel_error']:.2f} % | {100 * r['worst_rel_error']:.2f} % |" for r in checked]
            same_T = [n for n in runs if not n.startswith("wsd20_long")]
            law = json.loads((law_dir / "law.json").read_text())
            fitted_law = read_law(law_dir / "law.json")
            predicted = [fitted_law.final(_lr(runs[n]))[0] for n in same_T]
            measured = [final_of(runs[n], metric, window) for n in same_T]
            lines += ["", f"Kendall's tau over {len(same_T)} T-step schedules ({', '.join(same_T)}): {kendall_tau(predicted, measured):+.2f}",
                      "fit's own final errors: " + ", ".join(f"{r['run'].split('/')[-1]} {r['final_error']:+.4f}" for r in law["fit"]["runs"])]  # fmt: skip
            if fit_name == "A":  # one proposed run (CPU time), by fit A on train/loss: its val/loss is read too
                if metric == "train/loss":
                    propose = ("propose", str(law_dir / "law.json"), "--steps", str(T), "--family", "wsd")
                    text = forecast(*propose, refusal_ok=True)
                    refusal = text.split(": ", 1)[1] if text.startswith("refused: ") else ""
                    if refusal:  # measured anyway: what running a proposal the law could not choose costs
                        text = forecast(*propose, "--force")
                    proposed_line = next(line for line in text.splitlines() if line.startswith("proposed:"))
                    proposed_line += f" (propose refused: {refusal}; run with --force)" if refusal else ""
                    proposed = run_proposed(law_dir)
                else:
                    proposed_line = "the schedule proposed by fit A on train/loss"
                got = final_of(proposed, metric, window)
                best_name = min(same_T, key=lambda n: final_of(runs[n], metric, window))
                best = min(final_of(runs[best_name], metric, window), got)
                lines += [f"{proposed_line}; measured {got:.4f}; best measured T-step schedule {best_name} "
                          f"{final_of(runs[best_name], metric, window):.4f}; regret {got - best:+.4f}"]  # fmt: skip
            lines.append("")
    return "\n".join(lines)


def _lr(run_dir: Path) -> np.ndarray:
    from tinker_exp.forecast.runs import read_curve

    return read_curve(run_dir, "train/loss").lr


if __name__ == "__main__":
    main()
