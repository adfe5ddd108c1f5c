"""The forecast pruner (hydra.sweeper.pruner=forecast): prunes a trial by the forecast of its final objective.

A trial stops when its forecast final objective, with its interval, lies wholly worse than the best other trial's result
or forecast.

Pruners that judge a trial by its loss so far misjudge schedules by design: a WSD run looks like the constant run
until its decay, a cosine run looks good early and loses late. Each trial's plan is known (its plan.json: the lr of
every step it will send), so a loss-curve law (tinker_exp/forecast, the multi-power law by default) fitted to the
objective's own curve of the study's trials so far sees a decay coming, and forecasts each trial's final objective
with the interval of its refits (`Law.forecast`).

`ForecastPruner.judge(trial, others) -> Verdict` decides from plain data (`TrialCurve`s) and a fitter, apart from
any engine; `OptunaForecast` is Optuna's BasePruner around it: inside each trial's job (TrialReport's
`should_prune`), it reads every trial's state, result and reported values from the study's storage, and its plan
and settings from its run dir (the `run_dir` in its user_attrs). numpy, scipy and optuna; no torch, verl or ray.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from tinker_exp.forecast.fit import MIN_POINTS, REFITS, fit_law
from tinker_exp.forecast.laws import LAWS, warmup_end
from tinker_exp.forecast.runs import METRIC_CHOICES, Curve, ForecastError, run_settings, shared_keys, updates_seen

log = logging.getLogger(__name__)

FIT_SECONDS = 60.0
"""A fit's time bound: past it no further start or refit begins (fit_law's `deadline`; too few refits left: no law
this time). Fits on a study's val/loss curves took 1.3-7.5 s (2 trials of the tiny model, 15-28 points) and
6.5-24 s (curves drawn from the law: 2 to 10 trials of 60 points) on this 2-core machine at load 6-9, 16 refits
asked in each: the bound is above the slowest, so it cuts no normal fit and stops one that went astray. A run's
points are binned to at most 80, so the cost grows with the trials, not with their length."""
REFIT_GROWTH = 0.1
"""A group's law is fitted again once its points have grown by this fraction since its last fit (or a decay is
first seen); otherwise the held fit is reused. Fitting at every evaluation would cost a fit per evaluation per
trial; 10 % more points narrow an interval by about 5 % (1 / sqrt(1.1)), well below its width."""
FORECAST_STEPS = 100
"""objective_mode=min: the law's minimum over at most this many of the steps left (and the last)."""


@dataclass(frozen=True)
class TrialCurve:
    """One trial as the pruner sees it: its plan's lr, its reported objective, its state, result and group.

    Its plan's lr at every step, the objective it reported at each train/step, its state and (completed) result, and its
    group: trials of one group share model, data, batch size, optimizer and peak lr, which one law describes
    (tinker_exp/forecast/runs.py `shared_keys`)."""

    number: int
    state: str  # "running", "complete" or "pruned"
    lr: np.ndarray
    steps: np.ndarray
    values: np.ndarray
    result: float | None = None
    group: Hashable = ()


@dataclass(frozen=True)
class Verdict:
    """The pruner's answer: prune or not, what kind of answer, and the line that says why.

    The kinds: "prune", "go_on", "no_law", "no_forecast", "no_best"."""

    prune: bool
    kind: str
    line: str


@dataclass
class Fitted:
    """A group's law as last fitted (None: none identified, `why`), on how many points, whether they saw a decay."""

    law: Any
    why: str
    points: int
    decays: bool
    trials: int


class LawCache:
    """Laws by (scope, group), shared by the trials of one process.

    A study's trials on slots or pools are threads of the sweep's process. A group is fitted by one trial at a time, the
    others meanwhile use the law held."""

    def __init__(self) -> None:
        self.held: dict[Hashable, Fitted] = {}
        self.locks: dict[Hashable, threading.Lock] = {}
        self.lock = threading.Lock()

    def lock_for(self, key: Hashable) -> threading.Lock:
        with self.lock:
            return self.locks.setdefault(key, threading.Lock())


SHARED = LawCache()


def decays(lr: np.ndarray) -> bool:
    """Whether the lr changes after the warmup (what the decay terms describe)."""
    warm = warmup_end(lr)
    return bool(np.any(lr[warm + 1 :] != lr[warm:-1]))


def fitted_points(curve: TrialCurve, metric: str, from_step: int) -> tuple[int, bool]:
    """How many of the curve's points a fit uses, and whether the lr changed after the warmup before the last of them.

    The points after the warmup and `from_step`, as fit_law counts them; an lr change is a decay seen: the decay terms
    identified."""
    if not len(curve.steps):
        return 0, False
    updates = updates_seen(metric, curve.steps)
    warm = warmup_end(curve.lr)
    used = int(np.sum(updates > max(warm, from_step)))
    last = min(int(updates.max()), len(curve.lr))
    return used, bool(used and np.any(curve.lr[warm + 1 : last] != curve.lr[warm : last - 1]))


class ForecastPruner:
    """Judges a trial by the forecast of its final objective.

    The law of its group, fitted to its group's curves (`fitter`: fit_law's signature; at most one fit a call, none
    while the held one is recent enough), forecasts the trial's objective with an interval, and the trial is pruned when
    the interval's low end lies above the best bound of the others: a completed trial's result, or the high end of a
    running trial's forecast (one that has reported). No law, no forecast for this trial, or nothing to compare with: it
    prunes nothing and says so."""

    def __init__(
        self, metric: str, mode: str = "last", law: str = "mpl", from_step: int = 0, refits: int = REFITS,
        fit_seconds: float = FIT_SECONDS, refit_growth: float = REFIT_GROWTH, fitter: Callable[..., Any] = fit_law,
        cache: LawCache | None = None, scope: Hashable = (),
    ) -> None:  # fmt: skip
        self.metric, self.mode, self.kind, self.from_step = metric, mode, law, from_step
        self.refits, self.fit_seconds, self.refit_growth = refits, fit_seconds, refit_growth
        self.fitter, self.cache, self.scope = fitter, cache or LawCache(), scope

    def judge(self, trial: TrialCurve, others: Sequence[TrialCurve]) -> Verdict:
        fitted = self.law_for(trial.group, [trial, *(t for t in others if t.group == trial.group)])
        if fitted.law is None:
            return Verdict(False, "no_law", f"no law identified yet ({fitted.why}); prunes nothing")
        whose = "1 trial's" if fitted.trials == 1 else f"{fitted.trials} trials'"
        fit = f"{self.kind} law fitted to {whose} {fitted.points} points"
        if not fitted.decays and decays(trial.lr):  # the law's own reason would advise fitting a decay branch
            unknown = ", ".join(LAWS[self.kind].decay_params)
            return Verdict(False, "no_forecast", f"no forecast for this trial (its lr decays, and no trial's points have seen a decay yet: "
                                                 f"{unknown} not identified; {fit}); prunes nothing")  # fmt: skip
        mine = self.forecast(fitted.law, trial)
        if mine["reason"]:
            return Verdict(False, "no_forecast", f"no forecast for this trial ({mine['reason']}; {fit}); prunes nothing")
        best = self.best(others, trial.group, fitted)
        said = f"forecast {self.metric} {self.what(trial)} {interval(mine)}"
        if best is None:
            return Verdict(False, "no_best", f"{said}; no other trial has a result or a forecast yet ({fit}); prunes nothing")
        label, bound = best
        if mine["low"] > bound:
            return Verdict(True, "prune", f"{said}, wholly worse than {label} ({fit})")
        return Verdict(False, "go_on", f"{said}, not wholly worse than {label} ({fit})")

    def what(self, trial: TrialCurve) -> str:
        return f"at its end ({len(trial.lr)} steps)" if self.mode == "last" else "at its lowest"

    def forecast(self, law: Any, trial: TrialCurve) -> dict[str, Any]:
        """The trial's final objective: the law's final loss, or the lowest of what it reported and the law's curve.

        The law's final loss with objective_mode=last; with min, the lowest of what it reported and the law's curve over
        the steps left."""
        if self.mode == "last":
            return law.forecast(trial.lr)
        total, done = len(trial.lr), int(trial.steps.max()) + 1 if len(trial.steps) else 0
        left = np.unique(np.linspace(done, total - 1, min(FORECAST_STEPS, max(1, total - done))).round().astype(np.int64))
        found = law.forecast(trial.lr, np.clip(updates_seen(self.metric, left), 1, total), np.min)
        if len(trial.values):
            seen = float(np.min(trial.values))
            found = {**found, **{k: min(found[k], seen) for k in ("predicted", "low", "high")}}
        return found

    def best(self, others: Sequence[TrialCurve], group: Hashable, fitted: Fitted) -> tuple[str, float] | None:
        """The lowest bound another trial gives: its result, or the high end of its forecast.

        The forecast of a running trial that has reported, by its group's law: this one's, or another group's as last
        fitted by that group's trials."""
        bounds = []
        for other in others:
            if other.state == "complete" and other.result is not None:
                bounds.append((f"trial {other.number}'s result {other.result:.4g}", other.result))
            elif other.state == "running" and len(other.values):
                held = fitted if other.group == group else self.cache.held.get(self.key(other.group))
                if held is None or held.law is None:
                    continue
                theirs = self.forecast(held.law, other)
                if theirs["reason"] is None:
                    bounds.append((f"trial {other.number}'s forecast {interval(theirs)}", theirs["high"]))
        return min(bounds, key=lambda b: b[1], default=None)

    def key(self, group: Hashable) -> Hashable:
        """A group's law in the cache: by the study, the group and what the law is fitted with."""
        return (self.scope, group, self.kind, self.metric, self.from_step, self.refits)

    def law_for(self, group: Hashable, curves: Sequence[TrialCurve]) -> Fitted:
        """The group's law: the held one while it is recent enough, else fitted now.

        The held one while its points have grown by less than `refit_growth` and no decay was first seen since."""
        key = self.key(group)
        counted = [(c, *fitted_points(c, self.metric, self.from_step)) for c in curves]
        usable = [(c, n, d) for c, n, d in counted if n >= MIN_POINTS]
        points, decays = sum(n for _, n, _ in usable), any(d for _, _, d in usable)
        held = self.cache.held.get(key)
        if held is not None and held.decays == decays and points <= held.points * (1 + self.refit_growth):
            return held
        needed = 2 * len(LAWS[self.kind].params)
        if points < needed:  # no fit: fit_law would refuse it
            return Fitted(None, f"{points} of the {needed} points the {self.kind} law needs, in trials with {MIN_POINTS} or more after "
                          f"{self.start_word()}", points, decays, len(usable))  # fmt: skip
        lock = self.cache.lock_for(key)
        if not lock.acquire(blocking=False):  # another trial of this process fits it now: not waited for (training would)
            return held or Fitted(None, "another trial is fitting the first law", points, decays, len(usable))
        try:
            fitted = self.fit([c for c, _, _ in usable], points, decays)
            self.cache.held[key] = fitted
            return fitted
        finally:
            lock.release()

    def start_word(self) -> str:
        return f"step {self.from_step} and the warmup" if self.from_step else "the warmup"

    def fit(self, curves: list[TrialCurve], points: int, decays: bool) -> Fitted:
        """The law fitted now, from the law's generic starts, within `fit_seconds`.

        The same points give the same law, whichever trial fits it. Too few refits in that time: no law (2 refits would
        make too narrow an interval)."""
        as_curves = [Curve(f"trial {c.number}", Path(f"trial {c.number}"), c.lr, c.steps, c.values, [f"trial {c.number}"] * len(c.steps)) for c in curves]
        began = time.monotonic()
        try:
            law = self.fitter(self.kind, as_curves, self.metric, refits=self.refits, from_step=self.from_step, deadline=began + self.fit_seconds)
        except ForecastError as e:
            return Fitted(None, f"the fit failed: {e}", points, decays, len(curves))
        log.debug(f"forecast pruner: {self.kind} law fitted to {points} points of {len(curves)} trial(s) in {time.monotonic() - began:.1f} s")
        enough = max(2, self.refits // 2)
        if len(law.refits) < enough:
            why = (f"{len(law.refits)} of {self.refits} refits converged within fit_seconds={self.fit_seconds:g}; an interval needs {enough}")
            return Fitted(None, why, points, decays, len(curves))
        return Fitted(law, "", points, decays, len(curves))


def interval(found: Mapping[str, Any]) -> str:
    return f"{found['predicted']:.4g} in [{found['low']:.4g}, {found['high']:.4g}]"


class OptunaForecast(optuna.pruners.BasePruner):
    """hydra.sweeper.pruner=forecast, as Optuna's pruner.

    `prune(study, trial)` builds every trial's TrialCurve (the storage's states, results and reported values; each run
    dir's plan.json and config.yaml) and asks ForecastPruner; `verdict` keeps its last answer (the line a pruned trial's
    log gets). The job tells it its objective first (`objective`: TrialReport does); the sweeper only checks its
    arguments."""

    def __init__(self, law: str = "mpl", from_step: int = 0, refits: int = REFITS, fit_seconds: float = FIT_SECONDS, refit_growth: float = REFIT_GROWTH):
        for key, value, least in (("from_step", from_step, 0), ("refits", refits, 4)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{key}: {value!r} must be a whole number >= {least}" + (" (an interval needs refits)" if key == "refits" else ""))
        for key, value in (("fit_seconds", fit_seconds), ("refit_growth", refit_growth)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{key}: {value!r} must be a number > 0")
        if law not in LAWS:
            raise ValueError(f"law: {law!r} is not one of {', '.join(LAWS)}")
        self.args = {"law": law, "from_step": from_step, "refits": refits, "fit_seconds": float(fit_seconds), "refit_growth": float(refit_growth)}
        self.judge: ForecastPruner | None = None
        self.run_dir: Path | None = None
        self.verdict: Verdict | None = None
        self.plans = RunPlans()

    def objective(self, metric: str, mode: str, run_dir: Path | None = None, scope: Hashable = ()) -> None:
        """What the study optimises (trainer.objective and its mode) and this job's run dir.

        The run dir holds its own plan, should the storage not name it yet. `scope`: the study (its storage and name),
        which the shared laws are kept by."""
        self.judge = ForecastPruner(metric, mode, cache=SHARED, scope=scope, **self.args)
        self.run_dir = run_dir

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        if self.judge is None:
            self.verdict = Verdict(False, "no_law", "not told the study's objective; prunes nothing")
            return False
        trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING))
        mine = self.curve(trial, self.run_dir)
        if mine is None:
            self.verdict = Verdict(False, "no_law", "this trial's plan.json is not readable; prunes nothing")
            return False
        others = [c for t in trials if t.number != trial.number and (c := self.curve(t)) is not None]
        self.verdict = self.judge.judge(mine, others)
        return self.verdict.prune

    def curve(self, trial: FrozenTrial, run_dir: Path | None = None) -> TrialCurve | None:
        """The trial as the pruner sees it; None when its run dir has no readable plan yet."""
        where = trial.user_attrs.get("run_dir")
        planned = self.plans.of(Path(where) if where else run_dir)
        if planned is None:
            return None
        lr, group = planned
        steps = sorted(trial.intermediate_values)
        state = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned"}.get(trial.state, "running")
        return TrialCurve(trial.number, state, lr, np.array(steps, dtype=np.int64), np.array([trial.intermediate_values[s] for s in steps], dtype=np.float64),
                          trial.value if trial.state == TrialState.COMPLETE else None, group)  # fmt: skip


@dataclass
class RunPlans:
    """Each run dir's lr at every step and its group, read once (a plan does not change once the run started)."""

    read: dict[Path, tuple[np.ndarray, Hashable]] = field(default_factory=dict)

    def of(self, run_dir: Path | None) -> tuple[np.ndarray, Hashable] | None:
        if run_dir is None:
            return None
        if run_dir not in self.read:
            try:
                self.read[run_dir] = run_plan(run_dir)
            except (OSError, ValueError, KeyError, TypeError):
                return None  # not written yet (the trial is starting), or not a plan: judged without it
        return self.read[run_dir]


def run_plan(run_dir: Path) -> tuple[np.ndarray, Hashable]:
    """(the lr of every step of the run, from its plan.json), and its group: the peak lr and shared settings.

    A branch's steps before its branch point come from its trunk's plan; without an lr schedule, the optimizer's
    constant lr, as the run logs it in applied/lr. The group: the peak lr and the settings a law's runs must share
    (config.yaml)."""
    from tinker_exp.optim.preview import PLAN_FILE, history, read_plan_file
    from tinker_exp.train.start import SAVED_CONFIG

    if not (run_dir / SAVED_CONFIG).is_file():  # written after plan.json: the run is still starting
        raise FileNotFoundError(run_dir / SAVED_CONFIG)
    parts = history(run_dir)
    plan = read_plan_file(run_dir / PLAN_FILE)
    lr = np.array(lr_column(plan), dtype=np.float64)
    for part in parts[:-1]:  # a branch: the trunk's steps before it
        trunk = lr_column(read_plan_file(part.run_dir / PLAN_FILE))
        end = min(len(lr), part.end if part.end is not None else len(trunk), len(trunk))
        lr[part.first : end] = trunk[part.first : end]
    settings = shared_keys(run_settings(run_dir))
    return lr, (float(f"{lr.max():.12g}"), tuple(sorted((k, repr(v)) for k, v in settings.items())))


def lr_column(plan: Any) -> np.ndarray:
    if "lr" in plan.columns:
        return np.asarray(plan.column("lr"))
    return np.full(len(plan), float(plan.optimizer_values["lr"]))


def objective_error(config: Any) -> str | None:
    """Why the forecast pruner cannot judge the runs of a study's `config` (its `hydra` node included), or None.

    The laws forecast a falling loss, minimised (train/loss or val/loss, its last or lowest value)."""
    from omegaconf import OmegaConf

    from tinker_exp.train.objective import objective_metric

    given = "hydra.sweeper.pruner=forecast"
    prompts = getattr(getattr(config, "env", None), "prompts", None)
    if prompts is not None:
        return f"{given}: an RL run (env.prompts {prompts}): its losses are policy-gradient losses, not the falling loss the laws forecast"
    metric = objective_metric(config)
    if metric not in METRIC_CHOICES:
        return f"{given}: trainer.objective={metric}: the laws forecast a falling loss ({' or '.join(METRIC_CHOICES)}), not {metric}"
    mode = str(getattr(config.trainer.objective_mode, "value", config.trainer.objective_mode))
    if mode not in ("last", "min"):
        return f"{given}: trainer.objective_mode={mode}: the laws forecast a falling loss, judged by its last or lowest value (last or min)"
    if OmegaConf.select(config, "hydra.sweeper.direction", default=None) == "maximize":
        return f"{given}: hydra.sweeper.direction=maximize: the laws forecast a loss, which the study minimises (drop hydra.sweeper.direction)"
    return None
