"""python -m tinker_exp.forecast fit | check | rank | propose: see tinker_exp/forecast/__init__.py and docs/forecast.md."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from tinker_exp.errors import TinkerExpError, one_line
from tinker_exp.formats import not_a_folder, text_table
from tinker_exp.forecast.fit import Law, errors_of, fit_law, read_law, write_law
from tinker_exp.forecast.laws import LAWS, features
from tinker_exp.forecast.plans import FAMILIES, Candidate, describe_spec, family_specs, plan_lr, spec_lr, write_proposed
from tinker_exp.forecast.runs import METRIC_CHOICES, ForecastError, check_comparable, expand, read_curve, refuse_rl, shared_keys

PROG = "python -m tinker_exp.forecast"


def read_curves(paths: list[str], metric: str) -> list:
    curves = [read_curve(path, metric) for path in expand([Path(p) for p in paths])]
    refuse_rl(curves)
    return curves


OUTPUTS = ("law.json", "fit.png", "check.json", "rank.json", "propose.json", "override/proposed.yaml")
"""What fit, check, rank and propose write into a law's dir: a new fit there makes all of them stale."""


def out_folder(given: str, flag: str, *inside: str) -> Path:
    """An output folder given (and the folders to be made in it), checked before anything is read or written.

    A file where a folder is expected is one line, not mkdir's traceback."""
    why = next((w for w in (not_a_folder(Path(given, *inside[:i])) for i in range(len(inside) + 1)) if w), None)
    if why:
        raise ForecastError(f"{flag}: {why}")
    return Path(given)


def cmd_fit(args: argparse.Namespace) -> None:
    out_folder(args.out, "--out")
    if args.refits < 0:
        raise ForecastError(f"--refits: {args.refits}: a count of refits, 0 or more")
    if args.from_step < 0:
        raise ForecastError(f"--from-step: {args.from_step}: a step, 0 or more")
    out = Path(args.out)
    stale = [name for name in OUTPUTS if (out / name).exists()]
    if stale and not args.overwrite:
        raise ForecastError(f"--out: {args.out} already holds {', '.join(stale)} (a previous fit's); give another --out, or --overwrite to replace them all")
    curves = read_curves(args.runs, args.metric)
    check_comparable(curves)
    law = fit_law(args.law, curves, args.metric, refits=args.refits, from_step=args.from_step)
    fit = law.record["fit"]
    if fit["unidentified"]:
        # printed, not warnings.warn: shown once whatever the warning filters (a test's, a user's -W)
        print(f"{PROG}: warning: {', '.join(fit['unidentified'])} not identified (left at the starting values): no fitted run's lr changes after its "
              "warmup, so a schedule that decays gets no forecast; fit a decay branch too (docs/forecast.md#what-to-fit)", file=sys.stderr)  # fmt: skip
    for name in stale:  # the previous fit's outputs, all of them: none may sit beside a law it was not made with
        (out / name).unlink()
    out.mkdir(parents=True, exist_ok=True)
    write_law(law, out / "law.json")
    from tinker_exp.forecast.plot import write_fit_png

    refits = refits_line(law)
    write_fit_png(law, curves, out / "fit.png", f"{law.kind} law fitted on {len(curves)} runs ({law.metric}); {refits}")
    rows = [[r["run"], str(r["final_step"]), f"{r['actual']:.4f}", f"{r['predicted']:.4f}", f"{r['final_error']:+.4f}",
             f"{100 * r['mean_rel_error']:.2f}%", f"{100 * r['worst_rel_error']:.2f}%"] for r in fit["runs"]]  # fmt: skip
    print(text_table(["fitted run", "final step", "actual", "fit", "error", "mean rel", "worst rel"], rows))
    print(", ".join(f"{n}={v:.4g}" + (" (not identified)" if n in fit["unidentified"] else "") for n, v in zip(law.law.params, law.params)))
    print(refits)
    print(f"wrote {out / 'law.json'} and {out / 'fit.png'}")


def refits_line(law: Law) -> str:
    fit = law.record.get("fit", {})
    asked, failed = fit.get("refits_asked", len(law.refits)), fit.get("refits_not_converged", 0)
    return f"{len(law.refits)} of {asked} refits converged" + (f" ({failed} did not: left out of the intervals)" if failed else "")


def warn_if_another_regime(law: Law, name: str, peak: float, settings: dict | None, plan: bool = False) -> None:
    """Warn when a run checked or a `plan` ranked is outside the regime the law was fitted in.

    Another peak lr than the law's, or another model, data set, batch size or optimizer than the fitted runs' (their
    config.yaml): the forecast is an extrapolation, said in a warning (a plan's says what to add to it)."""
    if abs(peak - law.lr_scale) > 1e-9 * law.lr_scale:
        warnings.warn(f"{name}: peak lr {peak:g}, the law was fitted at {law.lr_scale:g}: an extrapolation", stacklevel=1)
    fitted = law.record.get("settings", {})
    for key, value in shared_keys(settings or {}).items():
        if key in fitted and fitted[key] != value:
            add = f" (add {key}={fitted[key]} to the plan)" if plan else ""
            warnings.warn(f"{name}: {key} is {value}, the fitted runs' {fitted[key]}: another regime than the law's{add}", stacklevel=1)


def cmd_check(args: argparse.Namespace) -> None:
    out = out_folder(args.out, "--out") if args.out else Path(args.law).parent
    law = read_law(Path(args.law))
    curves = read_curves(args.runs, law.metric)
    for curve in curves:
        warn_if_another_regime(law, curve.name, curve.peak, curve.settings)
    unidentified = law.record.get("fit", {}).get("unidentified", [])
    for curve in curves:
        if unidentified and features(curve.lr / law.lr_scale, [len(curve.lr)]).decays:
            print(f"{PROG}: warning: {curve.name} decays, and the law's {', '.join(unidentified)} were not identified (no fitted run decays): "
                  "its prediction after the decay starts is the starting values' guess", file=sys.stderr)  # fmt: skip
    results = []
    for curve in curves:
        found = errors_of(law, curve)
        results.append({k: found[k] for k in ("run", "final_step", "actual", "predicted", "final_error", "mean_rel_error", "worst_rel_error")})
    rows = [[r["run"], str(r["final_step"]), f"{r['actual']:.4f}", f"{r['predicted']:.4f}", f"{r['final_error']:+.4f}",
             f"{100 * r['mean_rel_error']:.2f}%", f"{100 * r['worst_rel_error']:.2f}%"] for r in results]  # fmt: skip
    print(text_table(["run", "final step", "actual", "predicted", "error", "mean rel", "worst rel"], rows))
    out.mkdir(parents=True, exist_ok=True)
    (out / "check.json").write_text(json.dumps({"runs": results}, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out / 'check.json'}")


def ranked(law: Law, candidates: list[Candidate]) -> list[dict]:
    """Candidates with a forecast sorted by it, then those with none, unranked.

    Each ranked candidate has its interval (refits' 5-95 %, widened by the fit's own final-loss error on its runs) and
    the candidates it cannot be told from (intervals overlap); each without a forecast says why ("no forecast": its
    reason)."""
    rows = [{"plan": c.name, "steps": len(c.lr), **law.forecast(c.lr), "spec": c.spec} for c in candidates]
    rows.sort(key=lambda r: (r["reason"] is not None, r["predicted"]))
    known = [r for r in rows if r["reason"] is None]
    for i, row in enumerate(rows):
        row["rank"] = i + 1 if row["reason"] is None else None
    for row in rows:
        row["not_separable_from"] = [o["rank"] for o in known if o is not row and o["low"] <= row["high"] and row["low"] <= o["high"]] if row["reason"] is None else []
    return rows


def _ties(ranks: list[int]) -> str:
    if not ranks:
        return "separable"
    shown = ",".join(map(str, ranks[:5]))
    return f"not separable from {shown}" + (f",... ({len(ranks)} in all)" if len(ranks) > 5 else "")


def print_ranked(rows: list[dict], law: Law) -> None:
    table = [[str(r["rank"]), r["plan"], str(r["steps"]), f"{r['predicted']:.4f}", f"[{r['low']:.4f}, {r['high']:.4f}]", _ties(r["not_separable_from"])]
             if r["reason"] is None else ["-", r["plan"], str(r["steps"]), "no forecast", "-", r["reason"]]
             for r in rows]  # fmt: skip
    print(text_table(["#", "plan", "steps", f"predicted {law.metric}", "interval", ""], table))
    print(f"interval: 5-95 % of {refits_line(law)}, widened by {law.misfit:.4f} (the fit's largest final-loss error on its own runs)")


def cmd_rank(args: argparse.Namespace) -> None:
    if args.out:
        out_folder(args.out, "--out")
    law = read_law(Path(args.law))
    candidates = [plan_lr(text, Path(args.config_dir) if args.config_dir else None) for text in args.plans]
    for c in candidates:
        warn_if_another_regime(law, f"plan {c.name!r}", float(c.lr.max()), c.settings, plan=True)
    rows = ranked(law, candidates)
    print_ranked(rows, law)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "rank.json").write_text(json.dumps({"plans": rows}, indent=1) + "\n", encoding="utf-8")


def cmd_propose(args: argparse.Namespace) -> None:
    out = out_folder(args.out, "--out", "override") if args.out else out_folder(str(Path(args.law).parent), "LAW", "override")
    if args.steps < 2:
        raise ForecastError(f"--steps: {args.steps}: a run of at least 2 steps")
    if args.top < 1:
        raise ForecastError(f"--top: {args.top}: a count of candidates, 1 or more")
    law = read_law(Path(args.law))
    specs = family_specs(args.family, args.steps, law.lr_scale, law.warmup_steps)
    candidates = [Candidate(describe_spec(s), spec_lr(s, args.steps), s) for s in specs]
    rows = ranked(law, candidates)
    best = rows[0]
    if best["reason"] is not None:
        raise ForecastError(f"propose: no candidate of --family {args.family} has a forecast ({best['reason']}); nothing written")
    tied = [r for r in rows[1:] if r["rank"] in best["not_separable_from"]]
    unknown = sum(r["reason"] is not None for r in rows)
    others = f"{len(tied)} of {len(rows) - 1} other candidates not separable from it" + (f", {unknown} with no forecast" if unknown else "")
    if len(rows) > 1 and len(rows) - 1 - len(tied) - unknown == 0 and not args.force:
        raise ForecastError(f"propose: none of the {len(rows) - 1} other candidates is separable from the best ({best['plan']}: {best['predicted']:.4f} "
                            f"in [{best['low']:.4f}, {best['high']:.4f}]; {others}): the law cannot choose; nothing written (--force writes it anyway)")  # fmt: skip
    header = [
        f"Proposed by {PROG} propose {args.law} --steps {args.steps} --family {args.family}" + (" --force" if args.force else ""),
        f"predicted final {law.metric} {best['predicted']:.4f} in [{best['low']:.4f}, {best['high']:.4f}] ({law.kind} law; {others})",
        f"run: python -m tinker_exp --config-dir {out.resolve()} +override=proposed",
    ]
    path = write_proposed(best["spec"], args.steps, law.record.get("settings", {}), header, out)
    print_ranked(rows[: args.top], law)
    (out / "propose.json").write_text(json.dumps({"proposed": best, "candidates": rows}, indent=1) + "\n", encoding="utf-8")
    print(f"proposed: {best['plan']}: predicted {best['predicted']:.4f} [{best['low']:.4f}, {best['high']:.4f}]"
          + (f"; {others}" if tied or unknown else ""))  # fmt: skip
    print(f"wrote {path}; run it: python -m tinker_exp --config-dir {out.resolve()} +override=proposed")


def cmd_corpus(args: argparse.Namespace) -> None:
    from tinker_exp.forecast.corpus import write_corpus

    out_folder(args.out, "OUT")
    for flag, value, least in (("--rows", args.rows, 1), ("--val-rows", args.val_rows, 1)):
        if value < least:
            raise ForecastError(f"{flag}: {value}: a count of rows, {least} or more")
    train, val = write_corpus(Path(args.out), args.rows, args.val_rows, args.seed)
    print(f"wrote {train} ({args.rows} rows) and {val} ({args.val_rows} rows), no prompt twice")
    print(f"train on it: python -m tinker_exp data.path={train} data.val_path={val} ... (a run of up to {args.rows} / trainer.batch_size steps sees no row twice)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Fit a loss-curve law to finished runs; check, rank and propose schedules.")
    sub = p.add_subparsers(dest="command", required=True)
    fit = sub.add_parser("fit", help="fit a law to runs (run dirs, sweep dirs, metrics.jsonl files): law.json, fit.png")
    fit.add_argument("runs", nargs="+", metavar="RUN")
    fit.add_argument("--law", choices=sorted(LAWS), default="mpl")
    fit.add_argument("--metric", choices=METRIC_CHOICES, default="train/loss")
    fit.add_argument("--out", default="forecast", help="dir of law.json and fit.png (default: forecast)")
    fit.add_argument("--overwrite", action="store_true", help="replace a previous fit in --out (its check, rank and propose outputs are removed)")
    fit.add_argument("--from-step", type=int, default=0, help="fit no point before this step (default: after the warmup)")
    fit.add_argument("--refits", type=int, default=16, help="bootstrap refits for the intervals (default 16)")
    fit.set_defaults(func=cmd_fit)
    check = sub.add_parser("check", help="predicted against measured on runs not fitted: check.json")
    check.add_argument("law", metavar="LAW")
    check.add_argument("runs", nargs="+", metavar="RUN")
    check.add_argument("--out", help="dir of check.json (default: the law's)")
    check.set_defaults(func=cmd_check)
    rank = sub.add_parser("rank", help="predicted final loss of candidate plans, with intervals")
    rank.add_argument("law", metavar="LAW")
    rank.add_argument("plans", nargs="+", metavar="PLAN", help='a dry run\'s dir, or a run\'s overrides in one argument: "+override=lr_cosine trainer.steps=400"')
    rank.add_argument("--config-dir", help="a config dir of your own, as python -m tinker_exp --config-dir")
    rank.add_argument("--out", help="write rank.json here")
    rank.set_defaults(func=cmd_rank)
    propose = sub.add_parser("propose", help="the best schedule of a family: DIR/override/proposed.yaml")
    propose.add_argument("law", metavar="LAW")
    propose.add_argument("--steps", type=int, required=True)
    propose.add_argument("--family", choices=FAMILIES, default="wsd")
    propose.add_argument("--out", help="dir of override/proposed.yaml (default: the law's)")
    propose.add_argument("--top", type=int, default=10, help="candidates printed (default 10)")
    propose.add_argument("--force", action="store_true", help="write proposed.yaml even when no candidate is separable from the best")
    propose.set_defaults(func=cmd_propose)
    corpus = sub.add_parser("corpus", help="write a generated SFT corpus of distinct rows (the laws' regime): OUT/corpus_train.jsonl, corpus_val.jsonl")
    corpus.add_argument("out", metavar="OUT")
    corpus.add_argument("--rows", type=int, default=8000, help="training rows (default 8000: 1000 steps of batch 8 without a repeat)")
    corpus.add_argument("--val-rows", type=int, default=160, help="held-out rows for val/loss (default 160)")
    corpus.add_argument("--seed", type=int, default=0)
    corpus.set_defaults(func=cmd_corpus)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    shown = warnings.formatwarning
    warnings.formatwarning = lambda message, *_: f"{PROG}: warning: {message}\n"  # one line, no source line
    try:
        args.func(args)
    except TinkerExpError as e:
        print(f"{PROG}: {one_line(e)}", file=sys.stderr)
        sys.exit(e.exit_code)
    except FileNotFoundError as e:  # a path given that is not there
        print(f"{PROG}: forecast error: {e.filename}: no such file or dir", file=sys.stderr)
        sys.exit(2)
    finally:
        warnings.formatwarning = shown


if __name__ == "__main__":
    main()
