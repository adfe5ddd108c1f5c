"""Optuna studies over tinker_exp runs: the search space from Hydra's override grammar, trials as sweep jobs.

Pure Python (optuna, Hydra's parser; no torch, verl or ray). The Hydra sweeper plugin
(hydra_plugins/tinker_exp_plugins/optuna_sweeper.py) asks for a batch of trials, launches them as one batch of
jobs through any launcher, and tells the study what each job returned. The study lives in SQLite in the sweep dir,
so the same command continues a killed study (`recover`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import optuna
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep, Transformer
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from tinker_exp.errors import ConfigError
from tinker_exp.train.objective import read_objective

RESULTS_FILE = "optimization_results.yaml"
STORAGE_FILE = "optuna.db"
CUT_OFF = "cut off: the study stopped while it ran"  # a failed trial without an error of its own

log = logging.getLogger(__name__)


def distribution(override: Override) -> BaseDistribution:
    """One search dimension: `interval(a, b)` (float; int when both ends are ints, e.g. `int(interval(0, 5))`),
    `tag(log, interval(...))` (log scale), `range(a, b[, step])` (ints, b excluded as in Python), and
    `choice(...)` or `a,b,c` (categorical)."""
    key, value = override.get_key_element(), override.value()
    if isinstance(value, IntervalSweep):
        log_scale = "log" in value.tags
        if log_scale and value.start <= 0:
            raise ConfigError(f"{key}: a log-scale interval must start above 0, not {value.start}")
        if value.start >= value.end:
            raise ConfigError(f"{key}: interval({value.start}, {value.end}) is empty")
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log_scale)
        return FloatDistribution(float(value.start), float(value.end), log=log_scale)
    if isinstance(value, RangeSweep) and not value.shuffle:
        start, stop, step = value.start, value.stop, value.step
        if not all(isinstance(x, int) for x in (start, stop, step)):
            raise ConfigError(f"{key}: range() must have int bounds and step for a search (use interval() for floats)")
        last = start + (len(range(start, stop, step)) - 1) * step
        if last < start:
            raise ConfigError(f"{key}: {expression(override)} is empty")
        return IntDistribution(start, last, step=step)
    if isinstance(value, (ChoiceSweep, RangeSweep)):
        return CategoricalDistribution(list(override.sweep_iterator(transformer=Transformer.encode)))
    raise ConfigError(f"{key}: {expression(override)} is not a search dimension")


def expression(override: Override) -> str:
    """The value as written on the command line (Hydra will not print a sweep)."""
    return (override.input_line or "").split("=", 1)[-1].strip()


def search_space(overrides: Iterable[Override]) -> tuple[list[str], dict[str, BaseDistribution]]:
    """(the overrides every trial gets, the search space by key). A later override of a key replaces an earlier
    one (the command line after hydra.sweeper.params)."""
    fixed: dict[str, str] = {}
    space: dict[str, BaseDistribution] = {}
    for override in overrides:
        key = override.get_key_element()
        fixed.pop(key, None)
        space.pop(key, None)
        if override.is_sweep_override():
            space[key] = distribution(override)
        else:
            fixed[key] = f"{key}={override.get_value_element_as_str()}"
    return list(fixed.values()), space


def as_override(key: str, value: Any) -> str:
    """`key=value` in Hydra's grammar; floats with every digit (repr), so the run gets the value sampled."""
    return f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"


def trial_label(params: Mapping[str, Any]) -> str:
    """Short, for tables and legends: floats to 3 significant digits (the exact values are in the storage)."""
    return " ".join(f"{key}={value:.3g}" if isinstance(value, float) else f"{key}={value}" for key, value in params.items())


def trial_overrides(fixed: Sequence[str], params: Mapping[str, Any]) -> list[str]:
    return list(fixed) + [as_override(key, value) for key, value in params.items()]


def running(study: optuna.Study) -> list[FrozenTrial]:
    """Trials asked and not told: a killed study's in-flight trials."""
    return study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING))


def trial_run_dir(trial: FrozenTrial) -> Path | None:
    """Recorded when the trial was asked, before its job was launched."""
    return Path(trial.user_attrs["run_dir"]) if "run_dir" in trial.user_attrs else None


def trial_error(trial: FrozenTrial) -> str | None:
    """Why a failed trial failed (recorded when its job failed; none recorded: it was cut off)."""
    return None if trial.state == TrialState.COMPLETE else trial.user_attrs.get("error", CUT_OFF)


def recover(study: optuna.Study) -> list[str]:
    """Trials a killed study left RUNNING: recorded from their run dirs when the run completed meanwhile,
    failed otherwise (cut off). Returns one line per trial, for the log. None is run again."""
    lines = []
    for trial in running(study):
        run_dir = trial_run_dir(trial)
        value = None if run_dir is None else read_objective(run_dir)
        if value is not None:
            study.tell(trial.number, value)
            lines.append(f"trial {trial.number}: completed while the study was down: {value:.6g} ({run_dir})")
        else:
            study.tell(trial.number, state=TrialState.FAIL)
            lines.append(f"trial {trial.number}: cut off while the study was down: failed ({run_dir})")
    return lines


def finished(study: optuna.Study) -> list[FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED))


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """The best completed trial, or None when none completed."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return study.best_trial if complete else None


def results(study: optuna.Study, storage: str) -> dict[str, Any]:
    """What optimization_results.yaml holds: the best trial (params, value, the overrides that reproduce it,
    its run dir), and every failed trial with why."""
    best = best_trial(study)
    failed = study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
    return {
        "name": "optuna",
        "study_name": study.study_name,
        "storage": storage,
        "direction": study.direction.name.lower(),
        "n_trials": len(finished(study)),
        "n_complete": len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))),
        "best_trial": None if best is None else best.number,
        "best_value": None if best is None else best.value,
        "best_params": {} if best is None else dict(best.params),
        "best_overrides": [] if best is None else list(best.user_attrs.get("overrides", [])),
        "best_run_dir": None if best is None else best.user_attrs.get("run_dir"),
        "failed": [
            {"trial": t.number, "overrides": list(t.user_attrs.get("overrides", [])), "error": trial_error(t)}
            for t in failed
        ],
    }
