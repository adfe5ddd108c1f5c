"""Fitting a law to curves, refits for its uncertainty, and law.json.

The fit is the recipe that reproduces the multi-power law's published figures: scipy's least_squares with a
Huber loss (f_scale 1e-3) on log residuals, from a few generic starts, keeping the lowest cost. The law is poorly
identified (other starts give other parameters with a similar error), so the fit also keeps refits: bootstrap
resamples of the fitted points, each started from the best fit with its shape parameters (all but L0, A) moved
by a random factor. Every prediction is made by the fit and by each refit: their spread is the interval, or no
forecast where it says nothing (Law.forecast). Fast on long curves: analytic Jacobians, every run in one
vectorised pass, the decay sum in blocks (FIT_RESOLUTION; benchmarks/forecast_fit.py). scipy and numpy only.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tinker_exp.forecast.laws import LAWS, LawKind, concat, features, predict, warmup_end
from tinker_exp.forecast.runs import Curve, ForecastError, NotConverged, updates_seen

FORMAT = "tinker_exp forecast law 1"
HUBER_SCALE = 1e-3
REFITS = 16
MIN_POINTS = 3  # per run, after its warmup
MAX_FIT_POINTS = 80
"""Per run, consecutive fitted points are averaged into at most this many (a fit evaluates the law thousands of
times: cost grows with points x lr changes; averaging neighbours also takes the batch noise out of train/loss)."""
REFIT_EVALUATIONS = 1000
"""A refit's most evaluations of the law (400 before the fit was fast: a refit along the law's flat valley, beta
near its bound, often needed more and was dropped as not converged)."""
FIT_RESOLUTION = 0.01
"""The fit's decay sum in blocks (laws.features): within 2e-7 (cosine) and 2e-5 (WSD, 1-sqrt) of the exact loss
on 24,000-step curves, far below any loss's noise, with 18 x fewer terms on a cosine: every start and every
refit on it, then the best start polished on the exact sum. Predictions, errors and plots are exact."""
FINAL_WINDOW = {"train/loss": 10, "val/loss": 1}
"""The final loss is the mean over this many last logged points: one train/loss is one batch's, noisy."""


@dataclass
class Law:
    """A fitted law: its kind, parameters, refits, the metric and lr scale it was fitted on, and its record."""

    kind: str
    params: np.ndarray
    refits: list[np.ndarray]
    metric: str
    lr_scale: float
    warmup_steps: int
    final_window: int
    from_step: int = 0  # no point before it was fitted, and none is checked (the law does not claim it)
    record: dict[str, Any] = field(default_factory=dict)  # runs, residuals, settings: law.json's other keys

    @property
    def law(self) -> LawKind:
        return LAWS[self.kind]

    def curve(self, lr: np.ndarray, updates: np.ndarray, params: np.ndarray | None = None) -> np.ndarray:
        """The predicted metric after `updates` updates of the schedule `lr` (raw lr, one value per update)."""
        return predict(self.law, self.params if params is None else params, np.asarray(lr) / self.lr_scale, np.asarray(updates))

    def final_updates(self, total_steps: int) -> np.ndarray:
        """The update counts behind the last `final_window` steps' metric of a run of `total_steps` steps."""
        steps = np.arange(max(0, total_steps - self.final_window), total_steps)
        return np.clip(updates_seen(self.metric, steps), 1, total_steps)

    def final(self, lr: np.ndarray, updates: np.ndarray | None = None, reduce: Callable[[np.ndarray], Any] = np.mean) -> tuple[float, float, float]:
        """The predicted final loss of a schedule: (the fit's, the 5th and 95th percentile over the refits).

        `updates`, `reduce`: the loss taken as `reduce` over the curve at these update counts instead (default: the mean
        over the last `final_window` steps; a study's objective_mode=min: the min over the evaluations left)."""
        updates = self.final_updates(len(lr)) if updates is None else np.asarray(updates, dtype=np.int64)
        f = features(np.asarray(lr) / self.lr_scale, updates)
        point = float(reduce(self.law.predict(self.params, f)))
        spread = [float(reduce(self.law.predict(p, f))) for p in self.refits] or [point]
        return point, float(np.percentile(spread, 5)), float(np.percentile(spread, 95))

    def forecast(self, lr: np.ndarray, updates: np.ndarray | None = None, reduce: Callable[[np.ndarray], Any] = np.mean) -> dict[str, Any]:
        """The final loss of a schedule with its interval, or the reason there is none.

        The interval: the refits' 5-95 %, widened by `misfit`. "reason" is None for a forecast. No forecast when the
        schedule decays and the fitted runs did not (the decay terms are their starting values), when the interval holds
        a negative loss, or when it is wider than the fitted losses' whole spread (it says nothing the fitted curves did
        not). `updates`, `reduce`: as `final`'s."""
        point, low, high = self.final(lr, updates, reduce)
        low, high = min(low, point) - self.misfit, max(high, point) + self.misfit
        reason = None
        unidentified = self.record.get("fit", {}).get("unidentified", [])
        at = self.final_updates(len(lr)) if updates is None else np.asarray(updates, dtype=np.int64)
        if unidentified and features(np.asarray(lr) / self.lr_scale, at).decays:
            reason = f"the schedule decays and {', '.join(unidentified)} were not identified: no fitted run decays (fit a decay branch too)"
        elif low < 0:
            reason = f"interval [{low:.4g}, {high:.4g}] holds negative losses (the refits disagree)"
        elif high - low > self.loss_spread > 0:
            reason = f"interval [{low:.4g}, {high:.4g}] is wider than the fitted losses' spread {self.loss_spread:.4g}"
        return {"predicted": point, "low": low, "high": high, "reason": reason}

    @property
    def loss_spread(self) -> float:
        """max - min of the fitted (binned) losses: an interval wider than this says nothing the runs did not."""
        return float(self.record.get("fit", {}).get("loss_spread", 0.0))

    @property
    def misfit(self) -> float:
        """The largest final-loss error on the fitted runs themselves: the floor of what a refit interval misses."""
        return max((abs(r["final_error"]) for r in self.record.get("fit", {}).get("runs", [])), default=0.0)


def _fit_points(curves: list[Curve], metric: str, from_step: int = 0) -> list[tuple[Curve, np.ndarray]]:
    """Per curve, the indices of its points the fit uses.

    After the warmup (the law's sums start there; warmup losses dominate a short run's residuals), and each logged point
    once (a branch's trunk steps are the trunk's points: fitted once when both are given). `from_step`: no point before
    it either (an early phase the law does not describe: the tiny model's first fast drop)."""
    seen: set[tuple[str, int]] = set()
    chosen = []
    for curve in curves:
        first = max(warmup_end(curve.lr), from_step)
        updates = updates_seen(metric, curve.steps)
        keep = []
        for i, (step, source) in enumerate(zip(curve.steps.tolist(), curve.sources)):
            if updates[i] > first and updates[i] >= 1 and (source, step) not in seen:
                seen.add((source, step))
                keep.append(i)
        chosen.append((curve, np.array(keep, dtype=np.int64)))
    return chosen


def binned(updates: np.ndarray, loss: np.ndarray, most: int = MAX_FIT_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive points averaged in groups so that at most `most` remain.

    The mean loss at the group's middle update (the law is smooth over a few steps)."""
    groups = np.array_split(np.arange(len(updates)), min(most, len(updates)))
    return (np.array([int(round(np.mean(updates[g]))) for g in groups], dtype=np.int64),
            np.array([float(np.mean(loss[g])) for g in groups]))  # fmt: skip


def fit_law(
    kind: str, curves: list[Curve], metric: str, refits: int = REFITS, seed: int = 0, from_step: int = 0, deadline: float | None = None
) -> Law:  # fmt: skip
    """Fit `kind` to the curves; NotConverged when no start converges, ForecastError on too few points.

    `deadline` (time.monotonic()): past it no further start or refit begins (the first start always runs); the
    refits not begun are counted in law.json's `fit.refits_skipped` (a study's forecast pruner bounds its fits)."""
    law_kind = LAWS[kind]
    lr_scale = max(c.peak for c in curves)
    chosen = _fit_points(curves, metric, from_step)
    for curve, keep in chosen:
        own = int(np.sum(updates_seen(metric, curve.steps) > max(warmup_end(curve.lr), from_step)))
        if own < MIN_POINTS:
            after = f"step {from_step}" if from_step > warmup_end(curve.lr) else "the warmup"
            raise ForecastError(f"{curve.path}: {own} {metric} points after {after}; a fit needs at least {MIN_POINTS} a run")
    for curve, keep in chosen:
        bad = keep[curve.loss[keep] <= 0]
        if len(bad):
            raise ForecastError(f"{curve.path}: {metric} is {curve.loss[bad[0]]:g} at step {curve.steps[bad[0]]}; the laws describe a positive loss "
                                "falling with the lr sum (an RL run's loss is not one)")  # fmt: skip
    total = sum(len(keep) for _, keep in chosen)
    if total < 2 * len(law_kind.params):
        raise ForecastError(f"{', '.join(c.name for c in curves)}: {total} {metric} points to fit; the {kind} law needs at least {2 * len(law_kind.params)}")
    parts, measured = [], []
    for c, keep in chosen:
        if len(keep):
            updates, loss = binned(updates_seen(metric, c.steps[keep]), c.loss[keep])
            parts.append(features(c.lr / lr_scale, updates, resolution=FIT_RESOLUTION))
            measured.append(np.log(loss))
    design, measured = concat(parts), np.concatenate(measured)
    problem = _Problem(law_kind, design, measured)
    lower, upper = np.array(law_kind.lower), np.array(law_kind.upper)

    def solve(problem: _Problem, start: np.ndarray, huber: bool, most: int, weights: np.ndarray | None = None):
        from scipy.optimize import least_squares

        robust = {"loss": "huber", "f_scale": HUBER_SCALE} if huber else {}
        return least_squares(problem.residuals, np.clip(start, lower, upper - 1e-9), jac=problem.jacobian, bounds=(lower, upper),
                             max_nfev=most, x_scale="jac", args=() if weights is None else (weights,), **robust)  # fmt: skip

    # Plain least squares first: from a generic start every residual is far beyond the Huber scale, where the loss
    # is flat in its curvature and the solver stops where it began; then the Huber fit from there.
    best, messages = None, []
    for start in law_kind.starts(np.exp(measured)):
        if best is not None and deadline is not None and time.monotonic() > deadline:
            break
        result = solve(problem, solve(problem, start, False, 1000).x, True, 1000)
        if result.status > 0 and np.all(np.isfinite(result.x)) and (best is None or result.cost < best.cost):
            best = result
        messages.append(result.message)
    if best is None:
        raise NotConverged(f"the {kind} law did not converge on {', '.join(c.name for c in curves)} ({messages[-1]}); no law.json written")
    if FIT_RESOLUTION and design.decays:  # the law's parameters are the exact sum's optimum: polished on it, from next to it
        exact = concat([features(c.lr / lr_scale, binned(updates_seen(metric, c.steps[keep]), c.loss[keep])[0]) for c, keep in chosen if len(keep)])
        polished = solve(_Problem(law_kind, exact, measured), best.x, True, 1000)
        if polished.status > 0 and np.all(np.isfinite(polished.x)):
            best = polished
    rng = np.random.default_rng(seed)
    refitted, failed, skipped = [], 0, 0
    shape = np.arange(len(best.x)) >= 2  # L0 and A are well determined; the rest is where starts disagree
    for _ in range(refits):
        if deadline is not None and time.monotonic() > deadline:
            skipped += 1
            continue
        weights = np.sqrt(np.bincount(rng.integers(0, len(measured), len(measured)), minlength=len(measured)).astype(float))
        start = best.x * np.where(shape, np.exp(rng.uniform(-0.7, 0.7, len(best.x))), 1.0)
        result = solve(problem, start, True, REFIT_EVALUATIONS, weights)
        if result.status > 0 and np.all(np.isfinite(result.x)):  # a refit that did not converge says nothing
            refitted.append(result.x)
        else:
            failed += 1
    # A proposed schedule's warmup: the longest fitted run's (the trunk's), not the shortest of runs that differ
    longest = max(curves, key=lambda c: len(c.lr))
    law = Law(kind, best.x, refitted, metric, lr_scale, warmup_end(longest.lr), FINAL_WINDOW.get(metric, 1), from_step)
    unidentified = [] if design.decays else list(law_kind.decay_params)
    law.record = {
        "runs": [{"run": str(c.path), "name": c.name, "steps": len(c.lr), "points": len(c.steps), "fitted_points": len(k)} for c, k in chosen],
        "settings": _common_settings(curves),
        "fit": {"cost": float(best.cost), "start_messages": messages, "refits": len(refitted), "refits_asked": refits, "refits_not_converged": failed,
                "refits_skipped": skipped, "unidentified": unidentified, "loss_spread": float(np.ptp(np.exp(measured)))},  # fmt: skip
    }
    law.record["fit"]["runs"] = [errors_of(law, c) for c in curves]
    return law


class _Problem:
    """The fit's residuals (log predicted - log measured, times a refit's weights) and their analytic Jacobian.

    Analytic: scipy's finite differences would cost one more evaluation of the law per parameter."""

    def __init__(self, law_kind: LawKind, design: Any, measured: np.ndarray) -> None:
        self.law_kind, self.design, self.measured = law_kind, design, measured

    def _raw(self, p: np.ndarray, jacobian: bool):
        with np.errstate(all="ignore"):
            out = self.law_kind.predict(p, self.design, jacobian=jacobian)
        return out if jacobian else (out, None)

    def residuals(self, p: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        predicted, _ = self._raw(p, False)
        with np.errstate(all="ignore"):
            r = np.log(np.maximum(predicted, 1e-12)) - self.measured
        r = np.where(np.isfinite(r), r, 10.0)  # a non-finite prediction is a large residual, not a crash
        return r if weights is None else r * weights

    def jacobian(self, p: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        predicted, jac = self._raw(p, True)
        usable = np.isfinite(predicted) & (predicted > 1e-12)  # where the residual is clamped, it does not move
        with np.errstate(all="ignore"):
            jac = np.where(usable[:, None], jac / np.where(usable, predicted, 1.0)[:, None], 0.0)
        jac = np.where(np.isfinite(jac), jac, 0.0)
        return jac if weights is None else jac * weights[:, None]


def _common_settings(curves: list[Curve]) -> dict[str, Any]:
    """The settings every fitted run with a config.yaml shares (a proposed run repeats the ones that matter)."""
    with_settings = [c.settings for c in curves if c.settings]
    if not with_settings:
        return {}
    keys = set.intersection(*(set(s) for s in with_settings))
    return {k: with_settings[0][k] for k in sorted(keys) if all(s[k] == with_settings[0][k] for s in with_settings)}


def errors_of(law: Law, curve: Curve) -> dict[str, Any]:
    """Predicted against measured over a run's logged points after its warmup: mean, worst error and final loss.

    The laws describe the loss from the peak on; at update 1 of a warmup from 0 they are infinite. The errors are
    relative: the mean and the worst. The final loss is the mean of the last `final_window` points, with its error
    (predicted - actual)."""
    updates = updates_seen(law.metric, curve.steps)
    first = max(warmup_end(curve.lr), law.from_step)
    at = updates > first
    if not np.any(at):
        raise ForecastError(f"{curve.path}: no {law.metric} logged after step {first} (the warmup, or the law's from_step)")
    predicted = law.curve(curve.lr, np.minimum(updates[at], len(curve.lr)))
    actual = curve.loss[at]
    relative = np.abs(predicted - actual) / actual
    window = min(law.final_window, len(actual))
    final_actual, final_predicted = float(np.mean(actual[-window:])), float(np.mean(predicted[-window:]))
    return {
        "run": curve.name,
        "final_step": int(curve.steps[at][-1]),
        "actual": final_actual,
        "predicted": final_predicted,
        "final_error": final_predicted - final_actual,
        "mean_rel_error": float(np.mean(relative)),
        "worst_rel_error": float(np.max(relative)),
        "steps": curve.steps[at].tolist(),
        "residuals": (actual - predicted).tolist(),
    }


def write_law(law: Law, path: Path) -> None:
    doc = {
        "format": FORMAT,
        "law": law.kind,
        "metric": law.metric,
        "params": dict(zip(law.law.params, law.params.tolist())),
        "lr_scale": law.lr_scale,
        "warmup_steps": law.warmup_steps,
        "final_window": law.final_window,
        "from_step": law.from_step,
        "refits": [dict(zip(law.law.params, p.tolist())) for p in law.refits],
        **law.record,
    }
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def read_law(path: Path) -> Law:
    """A law.json; ForecastError naming the file when it is not one."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ForecastError(f"{path}: not a law file ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("law") not in LAWS:
        raise ForecastError(f"{path}: not a law file (format {FORMAT!r} written by `python -m tinker_exp.forecast fit`)")
    names = LAWS[doc["law"]].params
    try:
        params = np.array([float(doc["params"][n]) for n in names])
        refits = [np.array([float(r[n]) for n in names]) for r in doc.get("refits", [])]
        record = {k: doc[k] for k in ("runs", "settings", "fit") if k in doc}
        law = Law(doc["law"], params, refits, doc["metric"], float(doc["lr_scale"]), int(doc["warmup_steps"]), int(doc["final_window"]), int(doc.get("from_step", 0)), record)
    except (KeyError, TypeError, ValueError) as e:
        raise ForecastError(f"{path}: key {e} missing or not a number") from None
    if not all(math.isfinite(v) for v in params):
        raise ForecastError(f"{path}: params: not finite")
    return law
