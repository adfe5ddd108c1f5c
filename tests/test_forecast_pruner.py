"""The forecast pruner (hydra.sweeper.pruner=forecast): its bookkeeping with a fake law (when it prunes, what it says,
when it fits; no workers), and one real study on the suite's warm pool."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

import numpy as np
import optuna
from optuna.trial import TrialState
import pytest
from omegaconf import OmegaConf

from helpers import run_cli, run_main, storage_trials
from tinker_exp.formats import read_json
from tinker_exp.forecast.runs import ForecastError
from tinker_exp.sweep.forecast_pruner import ForecastPruner, LawCache, OptunaForecast, TrialCurve
from tinker_exp.sweep.study import STUDY_ENV, TrialReport, open_storage, sweep_storage

STEPS = 40
CONSTANT = np.full(STEPS, 1e-3)
DECAYS = np.concatenate([np.full(8, 1e-3), np.full(STEPS - 8, 1e-5)])  # a step down to 1 % at step 8


class FakeLaw:
    """A fitted law's interface to the pruner: `forecast(lr, updates, reduce)` and its refits; `finals` holds the
    forecast (predicted, low, high) of a schedule that keeps its lr and of one that lowers it."""

    def __init__(self, finals: dict[str, tuple[float, float, float]], refits: int = 16):
        self.finals, self.refits, self.params = finals, [np.zeros(7)] * refits, np.arange(7.0)

    def forecast(self, lr, updates=None, reduce=np.mean):
        predicted, low, high = self.finals["decays" if lr[-1] < lr.max() else "constant"]
        return {"predicted": predicted, "low": low, "high": high, "reason": None}


class FakeFitter:
    """fit_law's signature; records each fit (the trials it was given) and its time bound."""

    def __init__(self, law=None, error: str | None = None):
        self.law, self.error, self.fits = law, error, []

    def __call__(self, kind, curves, metric, refits, from_step, deadline):
        self.fits.append(([c.name for c in curves], round(deadline - time.monotonic())))
        if self.error:
            raise ForecastError(self.error)
        return self.law


def curve(number: int, lr: np.ndarray, reported: int, state: str = "running", result: float | None = None, group="g") -> TrialCurve:
    """A trial that reported val/loss at its first `reported` evaluations (every 2 steps: train/step 1, 3, ...)."""
    steps = np.arange(1, 2 * reported, 2)
    return TrialCurve(number, state, lr, steps, np.linspace(5.0, 4.0, reported), result, group)


FINALS = {"constant": (4.0, 3.9, 4.1), "decays": (5.0, 4.8, 5.2)}  # constant: 4.0 in [3.9, 4.1]; the step down: 5.0 in [4.8, 5.2]


def test_a_trial_whose_interval_lies_wholly_worse_than_the_best_result_is_pruned_and_the_line_names_both():
    fitter = FakeFitter(FakeLaw(FINALS))
    pruner = ForecastPruner("val/loss", fitter=fitter)
    done = curve(0, CONSTANT, 20, "complete", result=4.05)
    verdict = pruner.judge(curve(1, DECAYS, 6), [done])
    assert verdict.prune and verdict.kind == "prune"
    assert verdict.line == ("forecast val/loss at its end (40 steps) 5 in [4.8, 5.2], wholly worse than trial 0's result 4.05 "
                            "(mpl law fitted to 2 trials' 26 points)")  # fmt: skip
    # Not wholly worse: an interval that reaches below the best's result goes on, and says against what.
    overlapping = ForecastPruner("val/loss", fitter=FakeFitter(FakeLaw({**FINALS, "decays": (4.5, 4.0, 5.0)})))
    verdict = overlapping.judge(curve(1, DECAYS, 6), [done])
    assert not verdict.prune and verdict.kind == "go_on"
    assert verdict.line.endswith("4.5 in [4, 5], not wholly worse than trial 0's result 4.05 (mpl law fitted to 2 trials' 26 points)")
    # The best trial itself is never pruned: its interval holds the others' bounds or lies below them.
    assert not pruner.judge(curve(0, CONSTANT, 6), [curve(1, DECAYS, 20, "complete", result=5.1)]).prune
    # objective_mode=min: the lowest of what it reported and of the law's curve left; a trial that already reported
    # below the best is not pruned, whatever its end.
    lowest = ForecastPruner("val/loss", "min", fitter=FakeFitter(FakeLaw(FINALS)))
    above = TrialCurve(1, "running", DECAYS, np.arange(1, 12, 2), np.array([6.0, 5.8, 5.6, 5.5, 5.4, 5.3]), None, "g")
    assert lowest.judge(above, [done]).line.startswith("forecast val/loss at its lowest 5 in [4.8, 5.2], wholly worse than")
    dipped = TrialCurve(1, "running", DECAYS, np.arange(1, 12, 2), np.array([5.0, 4.5, 4.0, 4.4, 4.9, 5.0]), None, "g")
    verdict = lowest.judge(dipped, [done])
    assert not verdict.prune and verdict.line.startswith("forecast val/loss at its lowest 4 in [4, 4], not wholly worse than trial 0's result 4.05")


def test_the_best_may_be_a_running_trials_forecast_its_high_end_the_bound():
    """Nothing completed yet: a running trial that has reported gives the high end of its forecast; one that has
    reported nothing, a pruned one and another group's trial without a held law give no bound."""
    pruner = ForecastPruner("val/loss", fitter=FakeFitter(FakeLaw(FINALS)))
    others = [curve(0, CONSTANT, 10), curve(2, CONSTANT, 0), curve(3, CONSTANT, 5, "pruned"), curve(4, CONSTANT, 5, group="other peak")]
    verdict = pruner.judge(curve(1, DECAYS, 6), others)
    assert verdict.prune and "wholly worse than trial 0's forecast 4 in [3.9, 4.1]" in verdict.line
    alone = pruner.judge(curve(1, DECAYS, 6), others[1:])
    assert not alone.prune and alone.kind == "no_best"
    assert alone.line.startswith("forecast val/loss at its end (40 steps) 5 in [4.8, 5.2]; no other trial has a result or a forecast yet")
    assert alone.line.endswith("; prunes nothing")


def test_before_a_law_is_identified_it_prunes_nothing_and_says_why():
    """Too few points (no fit tried), a fit that fails, refits that did not converge in the time bound, and a
    decaying schedule when no trial's points have seen a decay: each goes on, with its reason."""
    done = curve(0, CONSTANT, 20, "complete", result=4.05)
    fitter = FakeFitter(FakeLaw(FINALS))
    few = ForecastPruner("val/loss", fitter=fitter).judge(curve(1, DECAYS, 6), [curve(0, CONSTANT, 5, "complete", result=4.05)])
    assert (few.prune, few.kind) == (False, "no_law") and fitter.fits == []
    assert few.line == "no law identified yet (11 of the 14 points the mpl law needs, in trials with 3 or more after the warmup); prunes nothing"
    failed = ForecastPruner("val/loss", fitter=FakeFitter(error="the mpl law did not converge on trial 0, trial 1")).judge(curve(1, DECAYS, 6), [done])
    assert (failed.prune, failed.kind) == (False, "no_law")
    assert failed.line == "no law identified yet (the fit failed: the mpl law did not converge on trial 0, trial 1); prunes nothing"
    hurried = ForecastPruner("val/loss", fitter=FakeFitter(FakeLaw(FINALS, refits=3))).judge(curve(1, DECAYS, 6), [done])
    assert (hurried.prune, hurried.kind) == (False, "no_law")
    assert "3 of 16 refits converged within fit_seconds=60; an interval needs 8" in hurried.line
    # Trial 1 has reported only before its step down (at step 8): no point has seen a decay.
    unseen = ForecastPruner("val/loss", fitter=FakeFitter(FakeLaw(FINALS))).judge(curve(1, DECAYS, 4), [done])
    assert (unseen.prune, unseen.kind) == (False, "no_forecast")
    assert unseen.line.startswith("no forecast for this trial (its lr decays, and no trial's points have seen a decay yet: B, C, beta, gamma not identified")


def test_a_law_is_fitted_once_and_reused_until_its_points_grow_then_refitted_from_it():
    """Two trials of one group judged in turn share the law (one cache, as threads of one process do); 10 % more
    points (refit_growth) fit again, each fit within fit_seconds (60); while one trial fits, another uses the law
    held (or has none yet) rather than wait."""
    fitter = FakeFitter(FakeLaw(FINALS))
    cache = LawCache()
    first, second = (ForecastPruner("val/loss", fitter=fitter, cache=cache, scope="study") for _ in range(2))
    done = curve(0, CONSTANT, 20, "complete", result=4.05)
    first.judge(curve(1, DECAYS, 6), [done])  # 26 points, the decay seen
    second.judge(curve(2, DECAYS, 6), [done, curve(1, DECAYS, 6)])  # 32 points: more than 10 % more
    second.judge(curve(2, DECAYS, 7), [done, curve(1, DECAYS, 7)])  # 34: within 10 % of 32, reused
    first.judge(curve(1, DECAYS, 8), [done, curve(2, DECAYS, 7)])  # 35: within 10 % of 32, reused
    assert fitter.fits == [(["trial 1", "trial 0"], 60), (["trial 2", "trial 0", "trial 1"], 60)]
    with cache.lock_for(first.key("g")):  # a fit under way in another thread
        assert first.judge(curve(1, DECAYS, 20), [done, curve(2, DECAYS, 20)]).kind == "prune" and len(fitter.fits) == 2  # the held law
    other = ForecastPruner("val/loss", fitter=fitter, cache=cache, scope="another study")
    with cache.lock_for(other.key("g")):
        waiting = other.judge(curve(1, DECAYS, 6), [done])
    assert waiting.line == "no law identified yet (another trial is fitting the first law); prunes nothing" and len(fitter.fits) == 2
    other.judge(curve(1, DECAYS, 6), [done])
    assert len(fitter.fits) == 3  # another study's law is its own


@pytest.fixture
def study_dir(tmp_path):
    """A study in a journal with run dirs as the sweeper leaves them: trial 0 completed (constant lr), trial 1
    running (a step down at step 8), trial 2 running at another peak lr, trial 3 asked (no plan.json yet). Each
    run dir holds plan.json and config.yaml, written from a composed config as a run writes them."""
    from tinker_exp.forecast.plans import compose_config
    from tinker_exp.optim import build_plan
    from tinker_exp.run import write_plan

    study = optuna.create_study(study_name="tinker_exp", storage=open_storage(sweep_storage(tmp_path)))
    points = {0: ("1.0", "1e-3"), 1: ("0.01", "1e-3"), 2: ("1.0", "3e-3")}
    for number in range(4):
        trial = study.ask()
        trial.set_user_attr("run_dir", str(tmp_path / str(number)))
        if number in points:
            gamma, value = points[number]
            cfg = compose_config(["+override=lr_step", f"override.lr.gamma={gamma}", "override.lr.step_size=8", f"override.lr.value={value}", f"trainer.steps={STEPS}"])
            write_plan(build_plan(cfg.override, cfg.optimizer, STEPS), tmp_path / str(number), [])
            (tmp_path / str(number) / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        for step in range(1, 2 * (20 if number == 0 else 6), 2):
            trial.report(5.0 - step / 40, step)
        if number == 0:
            study.tell(trial, 4.05)
    return tmp_path


def test_in_a_trials_job_it_reads_the_study_and_run_dirs_logs_what_it_says_and_names_both_forecasts_when_it_prunes(study_dir, caplog, monkeypatch):
    """TrialReport with pruner=forecast, as a trial's job runs it (STUDY_ENV; refit_growth small: a fit at each
    evaluation): its law is fitted to the trials that share its peak lr and settings (trial 2's other peak and trial
    3's missing plan left out), each with its plan's lr; before a law, what it says is logged once; the stop line
    names its forecast and the best's result."""
    told = {"storage": sweep_storage(study_dir), "study_name": "tinker_exp", "pruner": "forecast", "pruner_args": {"refit_growth": 0.01}}
    monkeypatch.setenv(STUDY_ENV, json.dumps(told))
    report = TrialReport.from_environment("val/loss", 1, mode="last", run_dir=study_dir / "1")
    assert isinstance(report.pruner, OptunaForecast)
    fitter = FakeFitter(FakeLaw(FINALS), error="the mpl law did not converge on trial 1, trial 0")
    report.pruner.judge.fitter = fitter
    with caplog.at_level(logging.INFO, logger="tinker_exp.sweep.study"):
        first = report.evaluated(14, {"train/step": 13, "val/loss": 4.9})
        fitter.error = None
        second = report.evaluated(16, {"train/step": 15, "val/loss": 4.8})
    said = [r.getMessage() for r in caplog.records if r.name == "tinker_exp.sweep.study"]
    assert said == ["forecast pruner at step 14: no law identified yet (the fit failed: the mpl law did not converge on trial 1, trial 0); prunes nothing"]
    assert [names for names, _ in fitter.fits] == [["trial 1", "trial 0"]] * 2
    assert not first.stops and second.stops
    assert second.stop_line == ("pruned at step 16: val/loss 4.8; forecast val/loss at its end (40 steps) 5 in [4.8, 5.2], "
                                "wholly worse than trial 0's result 4.05 (mpl law fitted to 2 trials' 28 points)")  # fmt: skip
    # What the pruner gave the law: each trial's reported points and its plan's lr at every step.
    mine = report.pruner.curve(report.study.trials[1])
    assert mine.steps.tolist() == list(range(1, 17, 2)) and mine.lr.tolist() == [1e-3 * 0.01 ** (s // 8) for s in range(STEPS)]
    assert report.pruner.curve(report.study.trials[2]).group != mine.group and report.pruner.curve(report.study.trials[3]) is None


BASE = ["-m", "hydra/sweeper=optuna", "hydra/launcher=local", "optimizer.lr=interval(1e-4,1e-3)", "hydra.sweeper.pruner=forecast"]
REFUSED = [
    (["trainer.objective=requested/lr"],
     "hydra.sweeper.pruner=forecast: trainer.objective=requested/lr: the laws forecast a falling loss (train/loss or val/loss), not requested/lr"),
    (["trainer.objective_mode=max"],
     "hydra.sweeper.pruner=forecast: trainer.objective_mode=max: the laws forecast a falling loss, judged by its last or lowest value (last or min)"),
    (["hydra.sweeper.direction=maximize"],
     "hydra.sweeper.pruner=forecast: hydra.sweeper.direction=maximize: the laws forecast a loss, which the study minimises"),
    (["env=digits", "loss=importance_sampling", "trainer.objective=train/loss"],
     "hydra.sweeper.pruner=forecast: an RL run (env.prompts builtin:digits_train.jsonl): its losses are policy-gradient losses"),
    (["+hydra.sweeper.pruner_args.law=nope"], "hydra.sweeper.pruner_args (law=nope) for pruner forecast: law: 'nope' is not one of mpl, momentum"),
    (["+hydra.sweeper.pruner_args.refits=2"],
     "hydra.sweeper.pruner_args (refits=2) for pruner forecast: refits: 2 must be a whole number >= 4 (an interval needs refits)"),
    (["+hydra.sweeper.pruner_args.fit_seconds=0"], "hydra.sweeper.pruner_args (fit_seconds=0) for pruner forecast: fit_seconds: 0 must be a number > 0"),
    (["+hydra.sweeper.pruner_args.lw=mpl"],
     "hydra.sweeper.pruner_args.lw: pruner forecast has no argument lw; did you mean law? (forecast takes law, from_step, refits, fit_seconds, refit_growth)"),
    (["hydra.sweeper.pruner=patient", "+hydra.sweeper.pruner_args.patience=2", "+hydra.sweeper.pruner_args.wrapped=forecast"],
     "hydra.sweeper.pruner_args.wrapped: forecast: patient wraps another pruner (not none, patient or forecast)"),
]  # fmt: skip


@pytest.mark.parametrize("args, line", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_forecast_pruner_it_cannot_run_is_one_line_and_exit_2_before_anything(monkeypatch, capsys, tmp_path, args, line):
    code, out, err = run_main(monkeypatch, capsys, *BASE, f"hydra.sweep.dir={tmp_path / 'sweep'}", *args)
    assert code == 2, err
    assert err.strip().splitlines() == [f"tinker_exp: config error: {line}"] or err.strip().startswith(f"tinker_exp: config error: {line}"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in out + err
    assert not (tmp_path / "sweep").exists() and STUDY_ENV not in os.environ


def test_a_forecast_pruning_study_stops_a_clearly_bad_schedule_and_its_log_says_why(warm_pool, tmp_path):
    """hydra.sweeper.pruner=forecast on full fine-tuning (no slots): a grid of two step schedules at one peak lr,
    one at a time; trial 0 keeps its lr (gamma 1) and completes, trial 1 cuts it to 1 % at step 6 (gamma 0.01) and
    is pruned once the law fitted to both trials' val/loss sees its decay: its log names its forecast and trial 0's
    result, the forecast's interval wholly above it. Trial 0's log says it pruned nothing before a law was
    identified. Its trials train on the suite's warm pool, named (a sweep's own pools would start cold). (fit_seconds
    generous: a loaded machine does not cut its refits.)"""
    steps = 24
    result = run_cli(
        "-m", "hydra/sweeper=optuna", "hydra/launcher=local", f"hydra.sweep.dir={tmp_path}", f"trainer.steps={steps}", "trainer.eval_every=2",
        "trainer.batch_size=4", "backend.num_workers=1", "logger=none", "+override=lr_step", "override.lr.step_size=0.25",
        "override.lr.gamma=choice(0.01,1.0)", "hydra.sweeper.sampler=grid", "hydra.sweeper.n_jobs=1", "hydra.sweeper.pruner=forecast",
        "+hydra.sweeper.pruner_args.fit_seconds=600", f"backend.pool={warm_pool['TINKER_EXP_POOL_DIR']}/pool.sock",
        env=warm_pool, timeout=900,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    trials = storage_trials(tmp_path)
    assert [(t.params["override.lr.gamma"], t.state) for t in trials] == [(1.0, TrialState.COMPLETE), (0.01, TrialState.PRUNED)]
    said = (tmp_path / "1" / "tinker_exp.log").read_text()
    best = f"{trials[0].value:.4g}"
    stop = re.search(rf"pruned at step (\d+): val/loss [\d.]+; forecast val/loss at its end \({steps} steps\) [\d.]+ in \[([\d.]+), [\d.]+\], "
                     rf"wholly worse than trial 0's result {re.escape(best)} \(mpl law fitted to 2 trials' \d+ points\)", said)  # fmt: skip
    assert stop, said[-3000:]
    assert 6 < int(stop[1]) < steps and float(stop[2]) > trials[0].value  # after its decay, before its end
    assert read_json(tmp_path / "1" / "objective.json")["pruned_at_step"] == int(stop[1]) and f"trial 1: pruned at step {stop[1]}: " in out
    assert "forecast pruner at step 2: no law identified yet (0 of the 14 points the mpl law needs" in (tmp_path / "0" / "tinker_exp.log").read_text()
