"""Optuna studies over tinker_exp runs: the search space from Hydra's override grammar, trials as sweep jobs.

Pure Python (optuna, Hydra's parser; no torch, verl or ray). The Hydra sweeper plugin
(hydra_plugins/tinker_exp_plugins/optuna_sweeper.py) keeps n_jobs trials running as jobs of any launcher: as one
ends, it tells the study what the job returned and asks and starts the next. The study lives in Optuna's journal file in
the sweep dir (many jobs on a shared file system may write to it; an older study's optuna.db is still read), or at
any Optuna storage URL, so the same command continues a killed or stopped study (`recover`): a trial it cut off runs
again at its point, in its run dir, before any new one (`continue_cut_off`). With a pruner, each job reports
its evaluations to its trial (`TrialReport`) and stops when the pruner says so.
"""

from __future__ import annotations

import logging
import math
import statistics
import warnings
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import optuna
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep, Transformer
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from tinker_exp.errors import ConfigError
from tinker_exp.formats import masked  # noqa: F401 (the sweeper's and the tests' name for it)
from tinker_exp.train.judges import GO_ON, Decision, Judge, stop
from tinker_exp.train.objective import maximised, no_objective, objective_metric, read_objective, read_run_end
from tinker_exp.train.evaluation import missing_evaluation_data

RESULTS_FILE = "optimization_results.yaml"
JOURNAL_FILE = "optuna.journal"  # the default storage: Optuna's journal, safe for writers on several nodes
SQLITE_FILE = "optuna.db"  # what studies of earlier versions used: still read and written when it is there
JOURNAL = "journal://"  # our URL for a journal file (Optuna's own URLs are for databases)
STUDY_ENV = "TINKER_EXP_STUDY"  # what a job is told of its study: {"storage": URL, "study_name": ...} as JSON
CUT_OFF = "cut off: the study stopped while it ran"  # a failed trial without an error of its own
CONTINUES = "continues"
"""A trial's user attribute: the number of the cut-off trial it continues, at the same point, in that trial's run dir."""
JOB = "job"
"""A continuing trial's user attribute: the job number it runs as (its cut-off trial's: the run dir it resumes)."""
RETRY_OF = "retry_of"
"""A retry's user attribute: the number of the lost trial it runs again (tinker_exp/sweep/workers.py `lose`)."""

log = logging.getLogger(__name__)


def sweep_storage(sweep_dir: Path) -> str:
    """The storage of a study kept in its sweep dir: its journal, or an earlier version's optuna.db if only that is there."""
    sqlite, journal = sweep_dir / SQLITE_FILE, sweep_dir / JOURNAL_FILE
    if sqlite.exists() and not journal.exists():
        return f"sqlite:///{sqlite.resolve()}"
    return JOURNAL + str(journal.resolve())


def study_in(sweep_dir: Path) -> str | None:
    """The storage URL of the study kept in this dir, None when it holds none."""
    return sweep_storage(sweep_dir) if (sweep_dir / JOURNAL_FILE).exists() or (sweep_dir / SQLITE_FILE).exists() else None


def open_storage(url: str) -> Any:
    """What optuna's create_study/load_study take: a journal file's storage, or the database URL itself."""
    if url.startswith(JOURNAL):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

        # The open(O_EXCL) lock works on NFS too; its grace period frees a lock whose holder was killed.
        path = url[len(JOURNAL) :]
        return JournalStorage(JournalFileBackend(path, lock_obj=JournalFileOpenLock(path)))
    return url


NODE_LOCAL = ("tmpfs", "ramfs")
"""File systems in a node's own memory: a study file there is out of other nodes' reach, whatever its path."""


def unreachable_storage(url: str | None, sweep_dir: Path, opened_by: str, other_nodes: bool,
                        mounts: Path = Path("/proc/mounts")) -> str | None:  # fmt: skip
    """Why processes other than the sweep's cannot open the study at hydra.sweeper.storage `url`, or None.

    `opened_by`: its worker jobs, or its jobs reporting to their trials; `other_nodes`: on Slurm. A `url` of None (the
    journal in the sweep dir, which every node sees): None. An in-memory database is the sweep process's alone; a
    journal or SQLite file on a file system in a node's memory (tmpfs, where the sweep dir is not) is that node's alone.
    Whether any other folder is shared cannot be told from here."""
    if url is None:
        return None
    shown = f"hydra.sweeper.storage={masked(url)}"
    path: str | None = None
    if url.startswith(JOURNAL):
        path = url[len(JOURNAL) :]
    elif url.startswith("sqlite:"):
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            path = make_url(url).database or ""
        except ArgumentError:
            return None  # said by create_study, as any URL that does not parse
        if path in ("", ":memory:") or path.startswith("file::memory:") or "mode=memory" in url:
            return (f"{shown}: an in-memory database, which {opened_by} cannot open (each process would open a new, "
                    "empty one); give a file or a server URL, or leave it null (a journal file in the sweep dir)")  # fmt: skip
    if not path or not other_nodes:
        return None
    where, kind = mount_of(Path(path).absolute(), mounts)
    if kind in NODE_LOCAL and where != mount_of(sweep_dir.absolute(), mounts)[0]:
        return (f"{shown}: {where} is a {kind}, this node's own memory, which {opened_by} on other nodes cannot open; "
                "put the file in a folder every node sees (null: a journal file in the sweep dir)")  # fmt: skip
    return None


def mount_of(path: Path, mounts: Path = Path("/proc/mounts")) -> tuple[str, str]:
    """(mount point, file system type) of the file system that holds `path`; ("", "") where the table cannot be read.

    The file system of the longest mount point above it, in the `mounts` table."""
    try:
        table = [line.split()[1:3] for line in mounts.read_text().splitlines() if len(line.split()) > 2]
    except OSError:
        return "", ""
    found = ("", "")
    for where, kind in table:
        where = where.replace("\\040", " ")  # the table's escape for a space
        if (path == Path(where) or Path(where) in path.parents) and len(where) >= len(found[0]):
            found = (where, kind)
    return found


PRUNERS = {
    "none": "NopPruner",
    "median": "MedianPruner",
    "percentile": "PercentilePruner",
    "successive_halving": "SuccessiveHalvingPruner",
    "hyperband": "HyperbandPruner",
    "threshold": "ThresholdPruner",
    "patient": "PatientPruner",
    "forecast": "OptunaForecast",  # ours: tinker_exp/sweep/forecast_pruner.py
}


PRUNER_ARGS = "hydra.sweeper.pruner_args"


def study_direction(direction: str | None, metric: str, objective_mode: Any) -> str:
    """The study's direction: hydra.sweeper.direction when given, else the objective's.

    The objective's: train/objective.py `maximised` (maximize with trainer.objective_mode=max, or a reward's last value;
    else minimize). Given and contrary to a min or max mode: an error naming both keys."""
    mode = str(getattr(objective_mode, "value", objective_mode))
    implied = "maximize" if maximised(metric, mode) else "minimize"
    if direction is None:
        return implied
    if direction not in ("minimize", "maximize"):
        raise ConfigError(f"hydra.sweeper.direction: {direction!r} must be minimize or maximize")
    if mode in ("min", "max") and direction != implied:
        raise ConfigError(
            f"hydra.sweeper.direction={direction} contradicts trainer.objective_mode={mode} (higher is "
            f"{'better' if mode == 'max' else 'worse'}); drop hydra.sweeper.direction: it follows the mode"
        )
    return direction


def evaluations_error(pruner: str, config: Any) -> str | None:
    """Why a pruner would have nothing to judge in runs of `config` (the sweep's config: trainer, data, env), or None.

    An RL run (an env with prompts) is evaluated on its held-out prompts, any other run on validation data. The forecast
    pruner also needs an objective its laws forecast (forecast_pruner.objective_error)."""
    if why := missing_evaluation_data(config):
        return f"hydra.sweeper.pruner={pruner}: the pruner needs evaluations, and {why}"
    if not config.trainer.eval_every:
        return f"hydra.sweeper.pruner={pruner}: trainer.eval_every=0 evaluates only after the last step; the pruner has nothing to judge"
    if pruner == "forecast":
        from tinker_exp.sweep.forecast_pruner import objective_error

        return objective_error(config)
    return None


def pruner_class(name: str) -> type:
    """The class of pruner `name`: Optuna's, or ours (forecast)."""
    if name == "forecast":
        from tinker_exp.sweep.forecast_pruner import OptunaForecast

        return OptunaForecast
    return getattr(optuna.pruners, PRUNERS[name])


def pruner_arguments(name: str) -> dict[str, bool]:
    """The keyword arguments pruner `name` takes, each with whether it is required.

    Its Optuna class's; `patient`'s wrapped pruner named, not built."""
    import inspect

    taken = {p.name: p.default is p.empty for p in inspect.signature(pruner_class(name)).parameters.values()}
    if name == "patient":
        del taken["wrapped_pruner"]
        taken |= {"wrapped": False, "wrapped_args": False}
    return taken


def make_pruner(name: str, args: Mapping[str, Any], where: str = PRUNER_ARGS) -> optuna.pruners.BasePruner:
    """Optuna's pruner of that name (or ours: forecast), built from hydra.sweeper.pruner_args.

    pruner_args: its own keyword arguments; `patient` also takes `wrapped`, a pruner name, and `wrapped_args`. An
    argument it does not take is named with those it does; the pruner's own checks give the message for a value.
    `where`: the arguments' key, named in errors."""
    from tinker_exp.errors import suggest

    if name not in PRUNERS:
        key = "hydra.sweeper.pruner" if where == PRUNER_ARGS else f"{where.rpartition('.')[0]}.wrapped"
        known = PRUNERS if where == PRUNER_ARGS else [p for p in PRUNERS if p not in ("none", "patient", "forecast")]
        raise ConfigError(f"{key}: {name} is not a pruner" + suggest(str(name), known, "pruners:"))
    takes = pruner_arguments(name)
    for key in args:
        if key not in takes:
            raise ConfigError(f"{where}.{key}: pruner {name} has no argument {key}" + suggest(str(key), takes, f"{name} takes"))
    missing = [key for key, required in takes.items() if required and args.get(key) is None]
    if missing:
        raise ConfigError(
            f"{where}.{missing[0]}: pruner {name} needs it: type +{where}.{missing[0]}=VALUE ({name} takes {', '.join(takes)})"
        )
    kwargs = dict(args)
    if name == "patient":
        wrapped = kwargs.pop("wrapped", "median")
        if wrapped in ("none", "patient", "forecast"):  # forecast judges by its interval, with no patience to add
            raise ConfigError(f"{where}.wrapped: {wrapped}: patient wraps another pruner (not none, patient or forecast)")
        kwargs["wrapped_pruner"] = make_pruner(wrapped, kwargs.pop("wrapped_args", {}) or {}, f"{where}.wrapped_args")
    for key, value in kwargs.items():  # Optuna compares without checking types: "2" < 0 would be a TypeError
        if name == "forecast":
            break  # ours checks its own (a law's name is a string)
        if key == "wrapped_pruner" or value is None or (key in ("min_resource", "max_resource") and value == "auto"):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}.{key}: {value} must be a number")
    try:
        with warnings.catch_warnings():  # PatientPruner is "experimental"
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return pruner_class(name)(**kwargs)
    except (TypeError, ValueError) as e:
        given = ", ".join(f"{key}={value}" for key, value in args.items()) or "none given"
        raise ConfigError(f"{where} ({given}) for pruner {name}: {e}") from None


SAMPLERS = {
    "tpe": "TPESampler",
    "gp": "GPSampler",
    "cmaes": "CmaEsSampler",
    "random": "RandomSampler",
    "grid": "GridSampler",
}
SAMPLER_ARGS = "hydra.sweeper.sampler_args"
# Given by the sweeper, not sampler_args: the seed (hydra.sweeper.seed), the startup trials (hydra.sweeper.
# n_startup_trials), grid's points (the search space); the others take Python callables or objects.
SWEEPER_GIVES = {"seed", "n_startup_trials", "search_space", "independent_sampler", "constraints_func", "gamma", "weights", "source_trials"}


def sampler_arguments(name: str) -> dict[str, Any]:
    """The keyword arguments sampler `name` takes from hydra.sweeper.sampler_args, each with its signature's parameter.

    Its Optuna class's, less those the sweeper gives; the parameter with its annotation and default."""
    import inspect

    params = inspect.signature(getattr(optuna.samplers, SAMPLERS[name])).parameters
    return {p.name: p for p in params.values() if p.name not in SWEEPER_GIVES}


CHECKED_TYPES = {
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "None": (lambda v: v is None, "null"),
}
"""A sampler argument's annotated types that `wrong_type` checks a value against, and what it says the value must be."""


def wrong_type(value: Any, param: Any) -> str | None:
    """What `value` must be for a sampler's argument (`param`, its signature's parameter), or None.

    None where it fits or the argument's type is not one checked here (a dict, a callable). Its annotation says (Optuna
    5 gives many a default of None: `multivariate: bool | None = None`); without one, its default's type. Optuna checks
    few types before it samples: a string where a bool belongs would fail mid-study, or be taken as true."""
    import inspect

    annotation = param.annotation
    if annotation is inspect.Parameter.empty:
        default = param.default
        types = ["bool"] if isinstance(default, bool) else [type(default).__name__] if isinstance(default, (int, float)) else []
    else:  # Optuna's annotations are strings (`from __future__ import annotations`): 'bool | None'
        text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
        types = [part.strip() for part in text.replace("Optional[", "None | ").rstrip("]").split("|")]
    if not types or any(kind not in CHECKED_TYPES for kind in types):
        return None
    if any(CHECKED_TYPES[kind][0](value) for kind in types):
        return None
    musts = [CHECKED_TYPES[kind][1] for kind in types if kind != "None"]
    return " or ".join(musts) + (", or null" if "None" in types else "")


def space_error(name: str, space: Mapping[str, BaseDistribution]) -> str | None:
    """Why sampler `name` cannot serve this search space, or None.

    Optuna would fall back to independent random sampling with a warning (cmaes) or sample off its grid: the study would
    not be the one asked for."""
    if name == "cmaes":
        if choices := [k for k, d in space.items() if isinstance(d, CategoricalDistribution)]:
            return f"hydra.sweeper.sampler=cmaes: {choices[0]} is a choice; CMA-ES searches numbers only (use tpe or gp)"
        if len(space) < 2:
            return f"hydra.sweeper.sampler=cmaes: CMA-ES needs 2 or more searched keys, the space has {len(space)} (use tpe or gp)"
    if name == "grid":
        if ranges := [k for k, d in space.items() if isinstance(d, FloatDistribution)]:
            return (
                f"hydra.sweeper.sampler=grid: {ranges[0]} is a float interval, which has no grid; give its points with "
                f"choice(...) (or int bounds)"
            )
    return None


def grid_points(space: Mapping[str, BaseDistribution]) -> dict[str, list[Any]]:
    """Every value of each (enumerable) dimension: GridSampler's search space."""
    points: dict[str, list[Any]] = {}
    for key, dist in space.items():
        if isinstance(dist, CategoricalDistribution):
            points[key] = list(dist.choices)
        else:  # an IntDistribution: space_error refused floats
            points[key] = list(range(dist.low, dist.high + 1, dist.step))
    return points


def grid_size(space: Mapping[str, BaseDistribution]) -> int:
    return math.prod(len(values) for values in grid_points(space).values())


class GridToItsEnd(optuna.samplers.GridSampler):
    """Optuna's GridSampler without its study.stop() once every point has been asked.

    That stop raises outside study.optimize (the sweeper asks and tells); the sweeper runs at most the grid's points
    instead."""

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None) -> None:
        pass


def make_sampler(
    name: str, args: Mapping[str, Any], space: Mapping[str, BaseDistribution], seed: int, n_startup_trials: int
) -> optuna.samplers.BaseSampler:
    """Optuna's sampler of that name (hydra.sweeper.sampler) for this search space, seeded.

    hydra.sweeper.n_startup_trials for those that start with random trials (tpe, gp, cmaes), the grid's points from the
    space, and sampler_args its other keyword arguments. A name, argument or space it cannot serve: a ConfigError."""
    from tinker_exp.errors import suggest

    if name not in SAMPLERS:
        raise ConfigError(f"hydra.sweeper.sampler: {name} is not a sampler" + suggest(str(name), SAMPLERS, "samplers:"))
    takes = sampler_arguments(name)
    for key in args:
        if key in SWEEPER_GIVES:
            given = {"seed": "hydra.sweeper.seed", "n_startup_trials": "hydra.sweeper.n_startup_trials"}.get(key, "the search space")
            raise ConfigError(f"{SAMPLER_ARGS}.{key}: set by {given}, not here")
        if key not in takes:
            known = suggest(str(key), takes, f"{name} takes") if takes else f"; {name} takes none but the seed"
            raise ConfigError(f"{SAMPLER_ARGS}.{key}: sampler {name} has no argument {key}{known}")
        if (must := wrong_type(args[key], takes[key])) is not None:
            raise ConfigError(f"{SAMPLER_ARGS}.{key}: {args[key]!r} must be {must}")
    if why := space_error(name, space):
        raise ConfigError(why)
    kwargs: dict[str, Any] = {"seed": seed, **args}
    if name in ("tpe", "gp", "cmaes"):
        kwargs["n_startup_trials"] = n_startup_trials
    if name == "grid":
        kwargs["search_space"] = grid_points(space)
    given = ", ".join(f"{key}={value}" for key, value in args.items()) or "none given"
    try:
        with warnings.catch_warnings():  # experimental arguments (cmaes's, gp's) warn on every study
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            warnings.simplefilter("error", FutureWarning)  # an argument Optuna 5 deprecated: said, not half-used
            return (GridToItsEnd if name == "grid" else getattr(optuna.samplers, SAMPLERS[name]))(**kwargs)
    except FutureWarning as e:
        raise ConfigError(f"{SAMPLER_ARGS} ({given}) for sampler {name}: {str(e).split(' See ')[0]}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{SAMPLER_ARGS} ({given}) for sampler {name}: {e}") from None


def startup_note(name: str, n_startup_trials: int, n_trials: int) -> str:
    """What the study's first line says of sampler `name`'s startup trials; nothing for random and grid.

    Startup trials are random, before it models the results (tpe, gp, cmaes). The line says how many, or that they are
    every trial of the study (`hparams_search=lr_cosine hydra.sweeper.n_trials=8`: 10 startup trials leave TPE nothing
    to model)."""
    if name not in ("tpe", "gp", "cmaes"):
        return ""
    if n_startup_trials >= n_trials:
        return (f": every trial random (hydra.sweeper.n_startup_trials={n_startup_trials} >= the {n_trials} trials); set "
                f"hydra.sweeper.n_startup_trials lower for {name} to model the results")  # fmt: skip
    return f" (its first {n_startup_trials} trials random: hydra.sweeper.n_startup_trials)"


def distribution(override: Override) -> BaseDistribution:
    """One search dimension: an interval, a log-scale interval, a range or a choice.

    `interval(a, b)` (float; int when both ends are ints, e.g. `int(interval(0, 5))`), `tag(log, interval(...))` (log
    scale), `range(a, b[, step])` (ints, b excluded as in Python), and `choice(...)` or `a,b,c` (categorical)."""
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
    """(the overrides every trial gets, the search space by key).

    A later override of a key replaces an earlier one (the command line after hydra.sweeper.params)."""
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


def job_number(trial: FrozenTrial | optuna.Trial) -> int:
    """The job number a trial runs as (its run dir): its own number, or a continuing trial's cut-off trial's."""
    return trial.user_attrs.get(JOB, trial.number)


def cut_off(trial: FrozenTrial) -> bool:
    """Whether the trial failed without an error of its own: the study stopped while it ran.

    Ctrl-C, SIGTERM or a kill of the study's process; a continued study runs its point again (`continue_cut_off`)."""
    return trial.state == TrialState.FAIL and "error" not in trial.user_attrs


def continued(trials: Sequence[FrozenTrial]) -> set[int]:
    """Numbers of the cut-off trials that a later trial continues (asked, or waiting to be)."""
    return {t.user_attrs[CONTINUES] for t in trials if CONTINUES in t.user_attrs}


def settled(study: optuna.Study) -> list[FrozenTrial]:
    """Finished trials that count towards n_trials: complete, pruned, or failed of their own (an error).

    Not one cut off by the study's stop (its point runs again), nor a lost one that was retried (its retry counts)."""
    trials = study.get_trials(deepcopy=False)
    again = {t.user_attrs[RETRY_OF] for t in trials if RETRY_OF in t.user_attrs}
    return [t for t in finished(study) if t.number not in again and not cut_off(t)]


def superseded(trials: Sequence[FrozenTrial]) -> set[int]:
    """Cut-off trials that an asked trial continues: no row of their own in the summary, the continuation has it.

    The storage keeps them as they ended. A continuation still waiting (n_trials lowered since) leaves the cut-off
    trial its point's row."""
    return {t.number for t in trials if cut_off(t)} & continued([t for t in trials if t.state != TrialState.WAITING])


def continue_cut_off(study: optuna.Study) -> list[str]:
    """Enqueue each cut-off trial not continued yet at its point again; one line each.

    The new trial is asked before any new one and runs as the cut-off trial's job: the same overrides, the same run
    dir, so it resumes from the checkpoint kept there, else from step 0. It carries the cut-off trial's intermediate
    values (a pruner judges the run's whole history)."""
    from tinker_exp.train.start import branch_step

    trials = study.get_trials(deepcopy=False)
    already, lines = continued(trials), []
    for trial in trials:
        if not cut_off(trial) or trial.number in already:
            continue
        kept = {key: trial.user_attrs[key] for key in ("overrides", "run_dir") if key in trial.user_attrs}
        study.enqueue_trial(dict(trial.params), user_attrs={CONTINUES: trial.number, JOB: job_number(trial), **kept})
        again = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))[-1]
        for step, value in trial.intermediate_values.items():
            study._storage.set_trial_intermediate_value(again._trial_id, step, value)
        run_dir = trial_run_dir(trial)
        step = branch_step(run_dir) if run_dir is not None else None
        start = f"from its checkpoint at step {step}" if step is not None else "from step 0 (no checkpoint kept)"
        lines.append(f"trial {trial.number} (cut off): continued as trial {again.number} at the same point, in {run_dir or 'its run dir'} {start}")
    return lines


def trial_of_job(trials: Sequence[FrozenTrial], number: int) -> FrozenTrial:
    """The trial job `number` runs for: the newest trial running as that job, else the trial of that number.

    A trial running as another trial's job is a cut-off trial's continuation."""
    of_job = [t for t in trials if job_number(t) == number]
    return next((t for t in reversed(of_job) if t.state == TrialState.RUNNING), None) or next(t for t in trials if t.number == number)


def trial_point(trial: FrozenTrial | optuna.Trial, fixed: Sequence[str]) -> tuple[list[str], int]:
    """(the overrides a trial runs with, its job number).

    A continuation's are its cut-off trial's, as that one started (the same point, resumed in its run dir); any other
    trial's, its params after the fixed overrides, its own number as job number."""
    if CONTINUES in trial.user_attrs and "overrides" in trial.user_attrs:
        return list(trial.user_attrs["overrides"]), job_number(trial)
    return trial_overrides(fixed, trial.params), job_number(trial)


def running(study: optuna.Study) -> list[FrozenTrial]:
    """Trials asked and not told: a killed study's in-flight trials."""
    return study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING))


def trial_run_dir(trial: FrozenTrial) -> Path | None:
    """Recorded when the trial was asked, before its job was launched."""
    return Path(trial.user_attrs["run_dir"]) if "run_dir" in trial.user_attrs else None


def trial_error(trial: FrozenTrial) -> str | None:
    """Why a failed trial failed (recorded when its job failed; none recorded: it was cut off)."""
    return None if trial.state in (TrialState.COMPLETE, TrialState.PRUNED) else trial.user_attrs.get("error", CUT_OFF)


def recover(study: optuna.Study, keep_waiting: bool = False) -> list[str]:
    """Record what a killed or stopped study left unfinished, and continue its cut-off trials; one line per trial.

    Trials left RUNNING: recorded from their run dirs when the run completed meanwhile (failed with why when it
    returned no finite objective), else failed (cut off). Then every cut-off trial (these, and those a stopped study
    failed) is continued: its point enqueued again, to run in its run dir (`continue_cut_off`). Trials left WAITING:
    a continuation stays (it is asked first); a lost trial's retry (enqueued by study workers, not run yet) is kept
    for the study's workers to run first (`keep_waiting`), else failed (a job-per-trial study runs no retries)."""
    lines = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        if CONTINUES in trial.user_attrs:
            lines.append(f"trial {trial.number}: waiting (continues cut-off trial {trial.user_attrs[CONTINUES]}); run first")
        elif keep_waiting:
            lines.append(f"trial {trial.number}: waiting (a retry); the study's workers run it first")
        else:
            study._storage.set_trial_user_attr(trial._trial_id, "error", "a retry not run when the study stopped")
            study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
            lines.append(f"trial {trial.number}: a retry not run when the study stopped: failed")
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        run_dir = trial_run_dir(trial)
        end = {} if run_dir is None else read_run_end(run_dir)  # objective.json: the run completed
        value = None if run_dir is None else read_objective(run_dir)
        if value is not None and end.get("pruned_at_step") is not None:
            study.tell(trial.number, state=TrialState.PRUNED)
            lines.append(f"trial {trial.number}: pruned at step {end['pruned_at_step']} while the study was down: {value:.6g} ({run_dir})")
        elif value is not None:
            study.tell(trial.number, value)
            lines.append(f"trial {trial.number}: completed while the study was down: {value:.6g} ({run_dir})")
        elif end:  # completed without a finite objective: a failure of its own, as its job would have been told
            study._storage.set_trial_user_attr(trial._trial_id, "error", no_objective(end.get("value")))
            study.tell(trial.number, state=TrialState.FAIL)
            lines.append(f"trial {trial.number}: completed while the study was down without a finite objective: failed ({run_dir})")
        else:
            study.tell(trial.number, state=TrialState.FAIL)
            lines.append(f"trial {trial.number}: cut off while the study was down ({run_dir})")
    return lines + continue_cut_off(study)


def finished(study: optuna.Study) -> list[FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED))


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """The best completed trial, or None when none completed."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return study.best_trial if complete else None


def results(study: optuna.Study, storage: str) -> dict[str, Any]:
    """What optimization_results.yaml holds.

    The best trial (params, value, the overrides that reproduce it, its run dir), every pruned trial with where it
    stopped, every failed trial with why (not a cut-off one that a later trial continued), the trials that count
    towards n_trials, and the steps trained."""
    best = best_trial(study)
    gone = superseded(study.get_trials(deepcopy=False))
    failed = [t for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)) if t.number not in gone]
    pruned = study.get_trials(deepcopy=False, states=(TrialState.PRUNED,))
    ends = {t.number: read_run_end(trial_run_dir(t)) if trial_run_dir(t) else {} for t in finished(study)}
    return {
        "name": "optuna",
        "study_name": study.study_name,
        "storage": storage,
        "direction": study.direction.name.lower(),
        "n_trials": len(settled(study)),
        "n_complete": len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))),
        "best_trial": None if best is None else best.number,
        "best_value": None if best is None else best.value,
        "best_params": {} if best is None else dict(best.params),
        "best_overrides": [] if best is None else list(best.user_attrs.get("overrides", [])),
        "best_run_dir": None if best is None else best.user_attrs.get("run_dir"),
        "n_pruned": len(pruned),
        "pruned": [
            {"trial": t.number, "step": ends[t.number].get("pruned_at_step"), "value": t.value,
             "overrides": list(t.user_attrs.get("overrides", []))}
            for t in pruned
        ],  # fmt: skip
        "failed": [
            {"trial": t.number, "overrides": list(t.user_attrs.get("overrides", [])), "error": trial_error(t)}
            for t in failed
        ],
        # Of the trials that ran to their end or were pruned: what they trained, and what they would have unpruned.
        "steps_trained": sum(ends[t.number].get("steps", 0) for t in finished(study) if t.state != TrialState.FAIL),
        "steps_without_pruning": sum(
            ends[t.number].get("steps_planned", ends[t.number].get("steps", 0)) for t in finished(study) if t.state != TrialState.FAIL
        ),
    }


def steps_line(summary: Mapping[str, Any]) -> str:
    """The end of a pruning study: what pruning saved."""
    trained, unpruned = summary["steps_trained"], summary["steps_without_pruning"]
    share = f" ({trained / unpruned:.0%})" if unpruned else ""
    return f"steps trained: {trained}{share} of the {unpruned} a study without pruning would have trained; {summary['n_pruned']} trials pruned"


class TrialReport(Judge):
    """Inside a study's job, the judge of its trial in the study's storage: reports each evaluation, stops when pruned.

    Its trial is the job number's (`trial_of_job`: a cut-off trial's continuation where one runs). After each
    evaluation it reports the objective metric at the row's train/step and stops the run when the pruner says so (the
    checkpoint there records `pruned`); a resumed trial reports to the same trial (a step reported before is ignored
    by Optuna). The forecast pruner is told the objective (metric, mode) and the run dir; what it says without
    pruning goes to the job's log whenever it says something other than its numbers (no law yet, no forecast and
    why, ...)."""

    def __init__(self, metric: str, storage: str, study_name: str, number: int, pruner: str, pruner_args: Mapping[str, Any],
                 mode: str = "last", run_dir: Path | None = None):  # fmt: skip
        self.metric = metric
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.pruner = make_pruner(pruner, pruner_args)
        if hasattr(self.pruner, "objective"):  # the forecast pruner
            self.pruner.objective(metric, mode, run_dir, scope=(storage, study_name))
        self.study = optuna.load_study(study_name=study_name, storage=open_storage(storage), pruner=self.pruner)
        trial = trial_of_job(self.study.get_trials(deepcopy=False), number)
        self.number = trial.number
        self.trial = optuna.trial.Trial(self.study, trial._trial_id)
        self.pruned: tuple[int, float] | None = None  # (steps done, value) where it was pruned
        self.said: str | None = None  # the forecast pruner's last line in the log, its numbers left out

    @classmethod
    def from_environment(
        cls, metric: str, number: int | None, environ: Mapping[str, str] = os.environ, mode: str = "last", run_dir: Path | None = None
    ) -> "TrialReport | None":  # fmt: skip
        """The job's trial when its sweeper prunes (it sets STUDY_ENV), else None."""
        if number is None or STUDY_ENV not in environ:
            return None
        told = json.loads(environ[STUDY_ENV])
        return cls(metric, told["storage"], told["study_name"], number, told["pruner"], told.get("pruner_args", {}), mode, run_dir)

    @classmethod
    def for_run(cls, cfg: Any, run_dir: Path, job_number: int | None, wandb_config: dict[str, Any]) -> "TrialReport | None":
        mode = str(getattr(cfg.trainer.objective_mode, "value", cfg.trainer.objective_mode))
        return cls.from_environment(objective_metric(cfg), job_number, mode=mode, run_dir=run_dir)

    def evaluated(self, steps_done: int, row: Mapping[str, Any]) -> Decision:
        if not self.seen(steps_done, row):
            return GO_ON
        # A resumed pruned run is complete, as an early-stopped one.
        return stop(self.stop_line(steps_done), early_stopped=True, pruned=True)

    def seen(self, steps_done: int, row: Mapping[str, Any]) -> bool:
        """Report the row's value; True when the pruner stops the trial here."""
        value = row.get(self.metric)
        if value is None or not math.isfinite(value):
            return False
        with warnings.catch_warnings():  # a resumed trial's step reported again: Optuna keeps the first
            warnings.simplefilter("ignore", UserWarning)
            self.trial.report(float(value), int(row["train/step"]))
        prune = self.trial.should_prune()
        verdict = getattr(self.pruner, "verdict", None)
        # Said when it says something else, not when only its numbers changed: a line per evaluation would flood the log.
        if verdict is not None and not prune and (shape := re.sub(r"\d[\d.e+-]*", "N", verdict.line)) != self.said:
            log.info(f"forecast pruner at step {steps_done}: {verdict.line}")
            self.said = shape
        if prune:
            self.pruned = (steps_done, float(value))
            self.median = None if verdict is not None else self.others_median(int(row["train/step"]))
            return True
        return False

    def others_median(self, step: int) -> float | None:
        values = [
            t.intermediate_values[step]
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING))
            if t.number != self.number and step in t.intermediate_values
        ]
        return statistics.median(values) if values else None

    def stop_line(self, steps_done: int) -> str:
        """`pruned at step N: METRIC VALUE`, and why.

        Why: the forecast pruner's line (its forecast, the best's), or the median of the other trials at that step."""
        _, value = self.pruned
        verdict = getattr(self.pruner, "verdict", None)
        if verdict is not None:
            return f"pruned at step {steps_done}: {self.metric} {value:.6g}; {verdict.line}"
        others = "" if self.median is None else f" (median of the other trials {self.median:.6g})"
        return f"pruned at step {steps_done}: {self.metric} {value:.6g}{others}"
