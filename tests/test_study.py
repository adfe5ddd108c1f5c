"""Optuna studies (hydra/sweeper=optuna): the search space from Hydra's grammar, failed trials, a killed study
continued, and real studies with the local launcher and on the local Slurm cluster."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import optuna
import psutil
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from helpers import REPO, compose, environment, job_json, read_job_log, read_jsonl, requeue_at_time_limit, run_cli, start_cli, storage_trials, wait_until
from tinker_exp.errors import ConfigError
from tinker_exp.sweep.study import CUT_OFF, SAMPLERS, evaluations_error, grid_size, make_sampler, masked, open_storage, recover, results, search_space, steps_line, study_direction, study_in, sweep_storage
from tinker_exp.formats import read_json
from tinker_exp.sweep.slurm import slurm_states
from tinker_exp.train.checkpoints import latest
from tinker_exp.config import load
from tinker_exp.train.objective import maximised, objective_metric, objective_sign, read_objective, write_objective


def parse(*overrides: str):
    return OverridesParser.create().parse_overrides(list(overrides))


# --- pure: the search space and a killed study's bookkeeping ------------------------------------------


def test_search_space_is_written_in_hydras_grammar():
    fixed, space = search_space(
        parse(
            "+override=lr_cosine",
            "override.lr.value=tag(log, interval(1e-5, 1e-3))",
            "override.lr.warmup_steps=int(interval(0, 5))",
            "override.lr.min_ratio=interval(0, 0.5)",
            "trainer.batch_size=range(2, 10, 2)",  # 10 excluded, as in Python
            "+override=lr_wsd,lr_cosine",  # a later override of a key replaces the earlier one
            "data.split_seed=choice(1, 2)",
            "trainer.steps=5",
        )
    )
    assert fixed == ["trainer.steps=5"]
    assert space == {
        "override.lr.value": FloatDistribution(1e-5, 1e-3, log=True),
        "override.lr.warmup_steps": IntDistribution(0, 5),
        "override.lr.min_ratio": FloatDistribution(0.0, 0.5),
        "trainer.batch_size": IntDistribution(2, 8, step=2),
        "+override": CategoricalDistribution(["lr_wsd", "lr_cosine"]),
        "data.split_seed": CategoricalDistribution([1, 2]),
    }


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.lr=tag(log, interval(0, 1e-3))", "optimizer.lr: a log-scale interval must start above 0, not 0"),
        ("optimizer.lr=interval(1e-3, 1e-4)", "optimizer.lr: interval(0.001, 0.0001) is empty"),
        ("trainer.steps=range(5, 5)", "trainer.steps: range(5, 5) is empty"),
        ("optimizer.lr=range(0.1, 0.5, 0.1)", "optimizer.lr: range() must have int bounds and step"),
    ],
)
def test_a_bad_search_dimension_is_a_config_error(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        search_space(parse(override))


@pytest.mark.parametrize(
    "direction, mode, expected",
    [(None, "max", "maximize"), (None, "min", "minimize"), (None, "last", "minimize"),
     ("maximize", "last", "maximize"), ("minimize", "last", "minimize"), ("maximize", "max", "maximize")],
)
def test_the_study_direction_follows_the_objective_mode_unless_given(direction, mode, expected):
    cfg = compose(f"trainer.objective_mode={mode}")
    assert study_direction(direction, objective_metric(cfg), cfg.trainer.objective_mode) == expected


@pytest.mark.parametrize(
    "overrides, expected",
    [(("env=digits", "loss=importance_sampling"), "maximize"),  # eval/reward, its last value
     (("env=digits", "loss=importance_sampling", "env.eval_prompts=null"), "maximize"),  # train/reward
     (("env=digits", "loss=importance_sampling", "trainer.objective=train/ppo_kl"), "minimize"),
     (("env=digits", "loss=importance_sampling", "trainer.objective_mode=min"), "minimize")],
)
def test_an_rl_runs_reward_is_maximised_by_default_and_what_the_run_ranks_by_agrees(overrides, expected):
    """A reward's last value is maximised without trainer.objective_mode=max: the study's direction, the run's sign
    (early stop, keep_best, a population) and objective.json (the summaries) say the same."""
    cfg = compose(*overrides)
    metric = objective_metric(cfg)
    assert study_direction(None, metric, cfg.trainer.objective_mode) == expected
    assert objective_sign(load(cfg)) == (-1 if expected == "maximize" else 1)
    assert maximised(metric, cfg.trainer.objective_mode.value) is (expected == "maximize")


@pytest.mark.parametrize("direction, mode", [("minimize", "max"), ("maximize", "min")])
def test_a_direction_contrary_to_the_objective_mode_is_a_config_error(direction, mode):
    with pytest.raises(ConfigError, match=rf"^hydra.sweeper.direction={direction} contradicts trainer.objective_mode={mode} "):
        study_direction(direction, "val/loss", mode)


def test_a_pruner_judges_an_rl_run_on_its_held_out_prompts_and_needs_them():
    rl = ("env=digits", "loss=importance_sampling", "data.val_fraction=null")
    assert evaluations_error("median", compose(*rl)) is None  # no validation data: the env's eval prompts do
    assert evaluations_error("median", compose(*rl, "env.eval_prompts=null")) == (
        "hydra.sweeper.pruner=median: the pruner needs evaluations, and the env has no held-out prompts (env.eval_prompts)"
    )
    assert "trainer.eval_every=0" in evaluations_error("median", compose(*rl, "trainer.eval_every=0"))
    assert "no validation data" in evaluations_error("median", compose("data.val_fraction=null"))  # SFT as before


def test_a_killed_study_is_continued_from_its_storage_and_run_dirs(tmp_path):
    """Trials left RUNNING: completed meanwhile (objective.json in the run dir) -> told its value; completed without a
    finite value -> failed with why (its own failure, counted); cut off (no objective.json) -> failed, and its point
    enqueued again as a new trial that runs as its job (the same overrides and run dir, its intermediate values
    carried) and is asked before any new one. The cut-off trial counts neither towards n_trials nor as a failure of
    the study's once its continuation runs; the continuation counts once it ends. Recovering again enqueues nothing
    twice."""
    from tinker_exp.sweep.study import CONTINUES, JOB, settled, trial_point

    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="s", storage=storage)
    space = {"x": FloatDistribution(0.0, 1.0)}
    trials = [study.ask(space) for _ in range(4)]
    for trial in trials:
        (tmp_path / str(trial.number)).mkdir()
        trial.set_user_attr("run_dir", str(tmp_path / str(trial.number)))
        trial.set_user_attr("overrides", ["fixed=1", f"x={trial.params['x']!r}"])
    trials[2].report(3.5, 1)  # an evaluation before it was cut off
    study.tell(trials[0], 2.0)
    write_objective(tmp_path / "1", "val/loss", "last", 1.5)  # finished while the study was down
    write_objective(tmp_path / "3", "val/loss", "last", None)  # completed without a value: a failure
    del study  # the submitting process is gone

    continued = optuna.load_study(study_name="s", storage=storage)
    lines = recover(continued)
    states = [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.FAIL, TrialState.FAIL, TrialState.WAITING]
    assert [t.state for t in continued.trials] == states
    assert continued.trials[1].value == 1.5 and read_objective(tmp_path / "1") == 1.5
    assert lines == [
        f"trial 1: completed while the study was down: 1.5 ({tmp_path / '1'})",
        f"trial 2: cut off while the study was down ({tmp_path / '2'})",
        f"trial 3: completed while the study was down without a finite objective: failed ({tmp_path / '3'})",
        f"trial 2 (cut off): continued as trial 4 at the same point, in {tmp_path / '2'} from step 0 (no checkpoint kept)",
    ]
    again = continued.trials[4]
    assert again.intermediate_values == {1: 3.5}  # its params are fixed when it is asked (below)
    assert again.user_attrs == {CONTINUES: 2, JOB: 2, "overrides": trials[2].user_attrs["overrides"], "run_dir": str(tmp_path / "2")}
    assert [t.number for t in settled(continued)] == [0, 1, 3]  # the cut-off trial 2 does not count
    summary = results(continued, storage)
    assert summary["n_trials"] == 3 and summary["best_value"] == 1.5 and summary["best_trial"] == 1
    assert summary["best_run_dir"] == str(tmp_path / "1") and summary["best_overrides"] == trials[1].user_attrs["overrides"]
    # trial 3's failure is its own; trial 2's point is cut off until its continuation runs (then it is no failure)
    assert [(f["trial"], f["error"]) for f in summary["failed"]] == [(2, CUT_OFF), (3, "the run returned no finite objective (None)")]
    assert recover(continued) == ["trial 4: waiting (continues cut-off trial 2); run first"]  # nothing enqueued twice
    assert len(continued.trials) == 5

    asked = continued.ask(space)  # waiting: asked first, as the same job with the cut-off trial's overrides
    assert asked.number == 4 and asked.params == trials[2].params
    assert trial_point(asked, ["fixed=2"]) == (trials[2].user_attrs["overrides"], 2)
    assert trial_point(continued.ask(space), ["fixed=2"])[1] == 5  # a new trial: its own job, the fixed overrides now
    continued.tell(asked, 1.0)
    summary = results(continued, storage)
    assert summary["n_trials"] == 4 and summary["best_trial"] == 4 and [f["trial"] for f in summary["failed"]] == [3]


def test_a_continuation_cut_off_again_is_continued_as_the_same_job_and_a_job_reports_to_the_trial_it_runs(tmp_path):
    """A continuation cut off in its turn: continued again, as the first trial's job (its run dir), the newest
    continuing the one before. Inside the job, TrialReport (pruning) reports to the trial that runs as the job now,
    not to the cut-off one of its number; that trial's history holds the earlier evaluations too."""
    from tinker_exp.sweep.study import CONTINUES, JOB, TrialReport, continue_cut_off, superseded, trial_of_job

    url = f"journal://{tmp_path / 'optuna.journal'}"
    study = optuna.create_study(study_name="s", storage=open_storage(url))
    space = {"x": FloatDistribution(0.0, 1.0)}
    first = study.ask(space)
    first.report(4.0, 0)
    study.tell(first, state=TrialState.FAIL)  # Ctrl-C: cut off
    assert continue_cut_off(study)[0].startswith("trial 0 (cut off): continued as trial 1 at the same point")
    second = study.ask(space)
    study.tell(second, state=TrialState.FAIL)  # cut off again
    continue_cut_off(study)
    third = study.ask(space)
    frozen = study.trials
    assert (frozen[1].user_attrs[CONTINUES], frozen[1].user_attrs[JOB]) == (0, 0)
    assert (frozen[2].user_attrs[CONTINUES], frozen[2].user_attrs[JOB]) == (1, 0) and third.params == first.params
    assert superseded(frozen) == {0, 1} and trial_of_job(frozen, 0).number == 2
    report = TrialReport("val/loss", url, "s", 0, "median", {})
    assert report.trial.number == 2 and report.number == 2
    assert report.seen(1, {"train/step": 1, "val/loss": 3.0}) is False
    assert study.trials[2].intermediate_values == {0: 4.0, 1: 3.0} and study.trials[0].intermediate_values == {0: 4.0}


def test_a_study_of_an_earlier_version_keeps_its_sqlite_file_a_new_one_gets_a_journal(tmp_path):
    assert sweep_storage(tmp_path) == f"journal://{tmp_path.resolve() / 'optuna.journal'}" and study_in(tmp_path) is None
    optuna.create_study(study_name="old", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    assert sweep_storage(tmp_path) == study_in(tmp_path) == f"sqlite:///{(tmp_path / 'optuna.db').resolve()}"
    assert optuna.load_study(study_name="old", storage=open_storage(sweep_storage(tmp_path))).study_name == "old"
    assert masked("postgresql://bob:p@ss:w@db.lab:5432/studies") == "postgresql://bob:***@db.lab:5432/studies"
    assert masked("postgresql://bob@db.lab/studies") == "postgresql://bob@db.lab/studies"
    # Credential-shaped text in a URL that does not parse (a typo), quoted in an error, or on its own: masked too.
    assert masked("storage: postgresql//bob:s3cr3t@db.lab/studies") == "storage: postgresql//bob:***@db.lab/studies"
    assert masked("'postgresql:/bob:s3/cr3t@db'") == "'postgresql:***@db'"  # more than the password: never part of it
    assert masked("sqlite:///runs/a@b/optuna.db journal:///tmp/x@y") == "sqlite:///runs/a@b/optuna.db journal:///tmp/x@y"
    assert masked("hydra.sweeper.storage=bob:s3cr3t@db.lab") == "hydra.sweeper.storage=bob:***@db.lab"
    assert masked("redis://:s3cr3t@host/0") == "redis://:***@host/0"
    assert masked("trial 3: 1.5 (best: trial 2, 1.2); journal:///tmp/s/optuna.journal") == "trial 3: 1.5 (best: trial 2, 1.2); journal:///tmp/s/optuna.journal"


def test_a_storage_url_that_does_not_parse_is_one_line_and_its_password_is_in_nothing_printed_or_written(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m", "hydra/sweeper=optuna", "hydra/launcher=local", f"hydra.sweep.dir={sweep}", "logger=none",
        "hydra.sweeper.storage=postgresql//bob:s3cr3t@db.lab/studies", "optimizer.lr=tag(log,interval(1e-4,1e-3))",
    )  # fmt: skip
    assert result.returncode == 2 and result.stdout == "", result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        "tinker_exp: config error: hydra.sweeper.storage: postgresql//bob:***@db.lab/studies: cannot open the study: "
        "Could not parse SQLAlchemy URL from given URL string"
    ]
    assert not sweep.exists()  # refused: nothing written anywhere (no multirun.yaml), so no password either


def test_a_killed_pruning_study_records_a_trial_pruned_meanwhile_as_pruned(tmp_path):
    """A job that its pruner stopped while the study was down: PRUNED with its last reported value, where it
    stopped in optimization_results.yaml, and the steps it did not train counted."""
    storage = sweep_storage(tmp_path)
    study = optuna.create_study(study_name="s", storage=open_storage(storage))
    space = {"x": FloatDistribution(0.0, 1.0)}
    trials = [study.ask(space) for _ in range(2)]
    for trial in trials:
        trial.set_user_attr("run_dir", str(tmp_path / str(trial.number)))
        (tmp_path / str(trial.number)).mkdir()
    trials[0].report(3.0, 1)
    trials[0].report(2.5, 3)
    write_objective(tmp_path / "0", "val/loss", "last", 2.5, None, {"steps": 4, "steps_planned": 6, "pruned_at_step": 4})
    write_objective(tmp_path / "1", "val/loss", "last", 1.0, None, {"steps": 6, "steps_planned": 6})
    continued = optuna.load_study(study_name="s", storage=open_storage(storage))
    lines = recover(continued)
    assert [t.state for t in continued.trials] == [TrialState.PRUNED, TrialState.COMPLETE]
    assert continued.trials[0].value == 2.5 and "trial 0: pruned at step 4 while the study was down: 2.5" in lines[0]
    summary = results(continued, storage)
    assert summary["pruned"] == [{"trial": 0, "step": 4, "value": 2.5, "overrides": []}] and summary["best_trial"] == 1
    assert (summary["steps_trained"], summary["steps_without_pruning"]) == (10, 12)
    assert steps_line(summary) == "steps trained: 10 (83%) of the 12 a study without pruning would have trained; 1 trials pruned"


SPACES = {  # what each sampler is given below: two numbers, and a number beside a choice
    "numbers": ["override.lr.value=tag(log, interval(1e-4, 3e-3))", "override.lr.warmup_steps=int(interval(0, 3))"],
    "choice": ["override.lr.warmup_steps=int(interval(0, 3))", "data.split_seed=choice(1, 2, 3)"],
}


def run_study(sampler, space, n_trials: int = 8, seed: int = 0, **args) -> list:
    """An in-memory study of `n_trials` asked and told one by one (a quadratic bowl over the numbers, the choice's
    index added): the points the sampler chose."""
    study = optuna.create_study(sampler=sampler)
    for _ in range(n_trials):
        trial = study.ask(space)
        value = sum((math.log10(v) + 3) ** 2 if isinstance(v, float) else (v - 1) ** 2 for v in trial.params.values() if not isinstance(v, str))
        study.tell(trial, value)
    return [t.params for t in study.trials]


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_each_sampler_is_optunas_seeded_and_given_its_startup_trials_and_arguments(name):
    """hydra.sweeper.sampler=NAME: Optuna's class, the seed making its points (the same seed the same points, another
    seed others), n_startup_trials where it takes them, sampler_args passed on; every point inside the space."""
    space = search_space(parse(*SPACES["choice" if name in ("grid",) else "numbers"]))[1]
    sampler = make_sampler(name, {}, space, seed=3, n_startup_trials=2)
    assert isinstance(sampler, getattr(optuna.samplers, SAMPLERS[name]))
    if name in ("tpe", "gp", "cmaes"):
        assert sampler._n_startup_trials == 2
    points = run_study(sampler, space)
    assert points == run_study(make_sampler(name, {}, space, seed=3, n_startup_trials=2), space)
    assert points != run_study(make_sampler(name, {}, space, seed=4, n_startup_trials=2), space)
    for params in points:
        for key, value in params.items():
            assert space[key]._contains(space[key].to_internal_repr(value)), (key, value)
    if name == "grid":  # each of the 4 x 3 points once, in a seeded order; telling the last one stops nothing
        assert grid_size(space) == 12 and len({tuple(p.values()) for p in run_study(sampler, space, 12)}) == 12
    if name == "tpe":  # Optuna 5's TPE: multivariate, the constant liar; sampler_args sets either
        assert sampler._is_multivariate(optuna.create_study()) and sampler._constant_liar
        assert not make_sampler(name, {"multivariate": False}, space, 0, 10)._is_multivariate(optuna.create_study())
    if name == "cmaes":
        assert make_sampler(name, {"popsize": 5}, space, 0, 2)._popsize == 5
    if name == "gp":  # its acquisition's starts optimised together (optuna._gp.batched_lbfgsb), without Optuna's warning
        assert importlib.util.find_spec("greenlet") is not None, "greenlet (pyproject.toml) is not installed"


@pytest.mark.parametrize(
    "name, space, args, message",
    [
        ("cmaes", "choice", {}, "hydra.sweeper.sampler=cmaes: data.split_seed is a choice; CMA-ES searches numbers only (use tpe or gp)"),
        ("cmaes", ["override.lr.value=interval(0.1, 1.0)"], {}, "hydra.sweeper.sampler=cmaes: CMA-ES needs 2 or more searched keys, the space has 1"),
        ("grid", "numbers", {}, "hydra.sweeper.sampler=grid: override.lr.value is a float interval, which has no grid; give its points with choice(...)"),
        ("tpx", "numbers", {}, "hydra.sweeper.sampler: tpx is not a sampler; did you mean tpe? (samplers: tpe, gp, cmaes, random, grid)"),
        ("tpe", "numbers", {"multivariat": True}, "hydra.sweeper.sampler_args.multivariat: sampler tpe has no argument multivariat; did you mean multivariate?"),
        ("tpe", "numbers", {"seed": 1}, "hydra.sweeper.sampler_args.seed: set by hydra.sweeper.seed, not here"),
        ("random", "numbers", {"n_startup_trials": 1}, "hydra.sweeper.sampler_args.n_startup_trials: set by hydra.sweeper.n_startup_trials, not here"),
        ("random", "numbers", {"popsize": 4}, "hydra.sweeper.sampler_args.popsize: sampler random has no argument popsize; random takes none but the seed"),
        ("tpe", "numbers", {"n_ei_candidates": "many"}, "hydra.sweeper.sampler_args.n_ei_candidates: 'many' must be an int"),
        ("gp", "numbers", {"deterministic_objective": 1}, "hydra.sweeper.sampler_args.deterministic_objective: 1 must be true or false"),
        # Optuna 5 gives these a default of None: their annotations say what they take
        ("tpe", "numbers", {"multivariate": "yes"}, "hydra.sweeper.sampler_args.multivariate: 'yes' must be true or false, or null"),
        ("cmaes", "numbers", {"popsize": 4.5}, "hydra.sweeper.sampler_args.popsize: 4.5 must be an int, or null"),
        ("cmaes", "numbers", {"sigma0": 0.5}, "hydra.sweeper.sampler_args (sigma0=0.5) for sampler cmaes: `sigma0` has been deprecated in v4.9.0."),
    ],
)
def test_a_sampler_that_cannot_serve_the_space_or_an_argument_it_does_not_take_is_a_config_error(name, space, args, message):
    space = search_space(parse(*(SPACES[space] if isinstance(space, str) else space)))[1]
    with pytest.raises(ConfigError) as error:
        make_sampler(name, args, space, seed=0, n_startup_trials=10)
    assert str(error.value).startswith(message), str(error.value)


def test_a_study_begun_under_optuna_4_continues_under_optuna_5(tmp_path):
    """tests/data/optuna4.journal was written by Optuna 4.9.0 as the sweeper writes a study (TPE, seed 0, two trials
    of the space below with their overrides, run dirs and a report at step 1; trial 0 told 2.0, trial 1 left
    RUNNING: the study was killed). Optuna 5 reads it: the same trials, trial 1 recovered from its run dir, and the
    next trial asked is trial 2, inside the space."""
    journal = (REPO / "tests" / "data" / "optuna4.journal").read_text()
    (tmp_path / "optuna.journal").write_text(journal.replace("RUN_DIR", str(tmp_path)))
    (tmp_path / "1").mkdir()
    write_objective(tmp_path / "1", "val/loss", "last", 1.25)  # trial 1's run completed while the study was down
    assert optuna.__version__.startswith("5.") and study_in(tmp_path) == sweep_storage(tmp_path)
    study = optuna.load_study(study_name="tinker_exp", storage=open_storage(sweep_storage(tmp_path)))
    assert [(t.number, t.state, t.intermediate_values) for t in study.trials] == [
        (0, TrialState.COMPLETE, {1: 2.5}), (1, TrialState.RUNNING, {1: 1.5})
    ]
    assert study.trials[0].user_attrs["overrides"] == [f"{k}={v!r}" for k, v in study.trials[0].params.items()]
    assert recover(study) == [f"trial 1: completed while the study was down: 1.25 ({tmp_path / '1'})"]
    _, space = search_space(parse(*SPACES["numbers"]))
    study.sampler = make_sampler("tpe", {}, space, seed=2, n_startup_trials=10)
    trial = study.ask(space)
    assert trial.number == 2 and 1e-4 <= trial.params["override.lr.value"] <= 3e-3
    assert results(study, sweep_storage(tmp_path))["best_trial"] == 1


# --- the CLI: errors before anything runs, and a study whose trials all fail ---------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "config error: hydra.sweeper.params: no search space"),
        (["optimizer.lr=tag(log,interval(0,1))"], "config error: optimizer.lr: a log-scale interval must start above 0"),
        (["optimizer.lr=interval(1e-4,1e-3)", "hydra.sweeper.n_trials=0"], "config error: hydra.sweeper.n_trials: 0 must be an int >= 1"),
        (["optimizer.lr=interval(1e-4,1e-3)", "hydra.sweeper.n_jobs=0"], "config error: hydra.sweeper.n_jobs: 0 must be an int >= 1"),
        (["optimizer.lr=interval(1e-4,1e-3)", "hydra.sweeper.pruner=early"],
         "config error: hydra.sweeper.pruner: early is not a pruner (pruners: none, median,"),
        (["optimizer.lr=interval(1e-4,1e-3)", "hydra.sweeper.pruner=medain"],  # "did you mean", as for presets
         "config error: hydra.sweeper.pruner: medain is not a pruner; did you mean median? (pruners: none, median,"),
        (["optimizer.lr=interval(1e-4,1e-3)", "hydra.sweeper.pruner=median", "+hydra.sweeper.pruner_args.n_warmup_steps=-1"],
         "config error: hydra.sweeper.pruner_args (n_warmup_steps=-1) for pruner median: Number of warmup steps cannot be negative"),
        (["optimizer.lr=interval(1e-4,1e-3)", "hydra.sweeper.pruner=median", "+hydra.sweeper.pruner_args.n_startup_trials=two"],
         "config error: hydra.sweeper.pruner_args.n_startup_trials: two must be a number"),
        (["optimizer.lr=interval(1e-4,1e-3)", "hydra.sweeper.pruner=threshold", "+hydra.sweeper.pruner_args.uper=1"],  # not __init__()'s words
         "config error: hydra.sweeper.pruner_args.uper: pruner threshold has no argument uper; did you mean upper? "
         "(threshold takes lower, upper, n_warmup_steps, interval_steps)"),
        (["optimizer.lr=interval(1e-4,1e-3)", "hydra.sweeper.pruner=percentile"],
         "config error: hydra.sweeper.pruner_args.percentile: pruner percentile needs it: type "
         "+hydra.sweeper.pruner_args.percentile=VALUE (percentile takes percentile, n_startup_trials,"),
        (["optimizer.lr=interval(1e-4,1e-3)", "hydra.sweeper.pruner=threshold", "hydra.sweeper.pruner_args.upper=1"],  # no +
         "config error: hydra.sweeper.pruner_args.upper=1: hydra.sweeper.pruner_args does not set upper: type "
         "+hydra.sweeper.pruner_args.upper=1 (the + adds an argument the config does not set)"),
        (["optimizer.lr=interval(1e-4,1e-3)", "hydra.sweeper.pruner=median", "trainer.eval_every=0"],
         "config error: hydra.sweeper.pruner=median: trainer.eval_every=0 evaluates only after the last step"),
        (["optimizer.lr=interval(1e-4,1e-3)", "hydra.sweeper.pruner=threshold", "+hydra.sweeper.pruner_args.upper=1", "data.val_fraction=null"],
         "config error: hydra.sweeper.pruner=threshold: the pruner needs evaluations, and there is no validation data"),
        (["optimizer.lr=interval(1e-4,1e-3)", "trainer.objective_mode=max", "hydra.sweeper.direction=minimize"],
         "config error: hydra.sweeper.direction=minimize contradicts trainer.objective_mode=max (higher is better)"),
        (["optimizer.lr=interval(1e-4,1e-3)", "hydra.sweeper.storage=postgresql://bob:hunter2@127.0.0.1:1/studies"],
         "config error: hydra.sweeper.storage: postgresql://bob:***@127.0.0.1:1/studies: cannot open the study:"),
        (["optimizer.lr=interval(1e-4,1e-3)", "data.split_seed=choice(1,2)", "hydra.sweeper.sampler=cmaes"],  # refused before any trial
         "config error: hydra.sweeper.sampler=cmaes: data.split_seed is a choice; CMA-ES searches numbers only"),
        (["optimizer.lr=interval(1e-4,1e-3)", "hydra.sweeper.sampler=grid", "hydra.sweeper.sampler_args.x=1"],  # no +
         "config error: hydra.sweeper.sampler_args.x=1: hydra.sweeper.sampler_args does not set x: type +hydra.sweeper.sampler_args.x=1"),
        (["optimizer.lr=interval(1e-4,1e-3)", "hydra.sweeper.storage=db.lab/studies"],
         "config error: hydra.sweeper.storage: db.lab/studies: cannot open the study: Could not parse SQLAlchemy URL"),
    ],
)
def test_a_bad_study_is_one_line_and_exit_2_before_any_trial(tmp_path, args, message):
    result = run_cli("-m", "hydra/sweeper=optuna", "hydra/launcher=local", f"hydra.sweep.dir={tmp_path}", *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"tinker_exp: {message}"), result.stderr
    assert "Traceback" not in result.stderr and not list(tmp_path.glob("optuna.*"))
    assert "hunter2" not in result.stdout + result.stderr + "".join(p.read_text() for p in tmp_path.rglob("*.yaml"))


UNREACHABLE = [
    (["hydra/launcher=slurm_local", "hydra.launcher.workers=2", "hydra.sweeper.storage=sqlite://"],
     "hydra.sweeper.storage=sqlite://: an in-memory database, which the study's worker jobs (hydra.launcher.workers=2) cannot "
     "open (each process would open a new, empty one); give a file or a server URL, or leave it null (a journal file in the sweep dir)"),
    (["hydra/launcher=local", "hydra.sweeper.pruner=median", "hydra.sweeper.storage=sqlite:///:memory:"],
     "hydra.sweeper.storage=sqlite:///:memory:: an in-memory database, which the trials' jobs (they report to it for "
     "hydra.sweeper.pruner=median) cannot open"),
]  # fmt: skip


@pytest.mark.parametrize("args, line", UNREACHABLE, ids=["study-workers", "pruned-trials"])
def test_a_storage_the_studys_other_processes_cannot_open_is_one_line_before_anything_is_written(monkeypatch, capsys, tmp_path, args, line):
    """Study workers, and jobs that report to their trials, open the study themselves: an in-memory database is the
    sweep process's alone (each other process would open a new, empty one). Refused before anything is written or
    submitted (no multirun.yaml, no .submitit/)."""
    from helpers import run_main

    code, out, err = run_main(monkeypatch, capsys, "-m", "hydra/sweeper=optuna", *args, "+override=constant", "override.lr=interval(1e-4,1e-3)",
                              f"hydra.sweep.dir={tmp_path / 'sweep'}")  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.strip().startswith(f"tinker_exp: config error: {line}"), err
    assert not (tmp_path / "sweep").exists()


def test_a_study_file_in_a_nodes_own_memory_is_refused_for_workers_on_other_nodes(tmp_path):
    """A journal or SQLite file on a tmpfs (this node's memory) that the sweep dir is not on: out of other nodes'
    reach. The same file is fine for jobs on this machine, and on the sweep dir's own file system (the run dirs are
    there too, so every node sees it)."""
    from tinker_exp.sweep.study import unreachable_storage

    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\ntmpfs {tmp_path}/shm tmpfs rw 0 0\ntmpfs {tmp_path}/ram\\040disk ramfs rw 0 0\n")
    workers = "the study's worker jobs (hydra.launcher.workers=2)"
    for url in (f"journal://{tmp_path}/shm/study.journal", f"sqlite:///{tmp_path}/shm/sub/optuna.db", f"journal://{tmp_path}/ram disk/j"):
        why = unreachable_storage(url, tmp_path / "sweep", workers, True, mounts)
        assert why is not None and f"which {workers} on other nodes cannot open; put the file in a folder every node sees" in why, url
    assert "shm is a tmpfs, this node's own memory" in unreachable_storage(f"journal://{tmp_path}/shm/j", tmp_path, workers, True, mounts)
    assert unreachable_storage(f"journal://{tmp_path}/shm/j", tmp_path / "sweep", workers, False, mounts) is None  # jobs on this node
    assert unreachable_storage(f"journal://{tmp_path}/shm/j", tmp_path / "shm" / "sweep", workers, True, mounts) is None  # the sweep dir's
    assert unreachable_storage(f"journal://{tmp_path}/j", tmp_path / "sweep", workers, True, mounts) is None
    assert unreachable_storage(None, tmp_path, workers, True, mounts) is None  # the journal in the sweep dir
    assert unreachable_storage("postgresql://bob:pw@db/s", tmp_path, workers, True, mounts) is None


def test_failed_trials_are_recorded_and_the_study_goes_on_exit_1_when_none_completed(tmp_path):
    """Every point is a config error (an odd batch does not split over 2 workers): each trial fails before any
    job, the study asks every trial anyway, names the failures and exits 1."""
    result = run_cli(
        "-m", "hydra/sweeper=optuna", "hydra/launcher=local", f"hydra.sweep.dir={tmp_path}",
        "trainer.batch_size=choice(3,5,7)", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=2",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "none of the 3 trials completed" in result.stderr
    trials = storage_trials(tmp_path)
    assert [t.state for t in trials] == [TrialState.FAIL] * 3
    assert all("config error: trainer.batch_size" in t.user_attrs["error"] for t in trials)
    for t in trials:  # named in the log, each with its overrides
        assert f"failed trial {t.number} [trainer.batch_size={t.params['trainer.batch_size']}]" in result.stdout
    saved = OmegaConf.load(tmp_path / "optimization_results.yaml")
    assert saved.best_trial is None and [f.trial for f in saved.failed] == [0, 1, 2]
    assert [row["status"] for row in read_jsonl(tmp_path / "summary.jsonl")] == ["FAILED"] * 3


def test_a_dry_run_study_plans_its_trials_and_records_nothing(tmp_path):
    """dry_run=true: each trial's job plans its point (plan.json, the sampled value in it), exit 0, and the sweep dir
    holds no study (a later real study there starts from trial 0); a point that fails its checks is named, exit 1."""
    args = ["-m", "hydra/sweeper=optuna", "hydra/launcher=local", "dry_run=true", "+override=lr_cosine",
            "override.lr.value=tag(log,interval(1e-4,3e-3))", "hydra.sweeper.n_trials=2", "hydra.sweeper.pruner=median"]  # fmt: skip
    result = run_cli(*args, f"hydra.sweep.dir={tmp_path / 'good'}")
    assert result.returncode == 0, result.stderr
    assert f"dry run: 2 trials planned in {tmp_path / 'good'}; nothing trained" in result.stdout
    # the 10 startup trials (the default) are the whole study: said in its first line, not a silent random search
    assert ("at a time, sampler tpe: every trial random (hydra.sweeper.n_startup_trials=10 >= the 2 trials); "
            "set hydra.sweeper.n_startup_trials lower for tpe to model the results") in result.stdout, result.stdout
    assert not list((tmp_path / "good").glob("optuna.*")) and not (tmp_path / "good" / "optimization_results.yaml").exists()
    for trial in ("0", "1"):
        assert (tmp_path / "good" / trial / "plan.json").is_file() and not (tmp_path / "good" / trial / "metrics.jsonl").exists()
    result = run_cli(*args, "trainer.batch_size=choice(3,5)", f"hydra.sweep.dir={tmp_path / 'bad'}")
    assert result.returncode == 1 and "dry run: 2 of 2 trials failed their checks; nothing trained" in result.stderr, result.stderr
    assert "config error: trainer.batch_size" in result.stdout and "Traceback" not in result.stderr


def test_a_grid_study_plans_each_point_of_its_grid_once_and_no_more_trials(tmp_path):
    """hydra.sweeper.sampler=grid through the CLI (a dry run): n_trials=20 over a 2 x 2 grid runs the grid's 4 trials,
    each point once, said in the log."""
    result = run_cli(
        "-m", "hydra/sweeper=optuna", "hydra/launcher=local", "dry_run=true", "+override=lr_cosine", f"hydra.sweep.dir={tmp_path}",
        "hydra.sweeper.sampler=grid", "override.lr.value=choice(1e-4,1e-3)", "override.lr.warmup_steps=range(0,2)",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "grid of 4 points: the study runs 4 trials, not 20" in result.stdout and "sampler grid" in result.stdout
    planned = sorted((plan["override"]["lr"]["value"], plan["override"]["lr"]["warmup_steps"])
                     for plan in (read_json(tmp_path / str(n) / "plan.json") for n in range(4)))  # fmt: skip
    assert planned == [(1e-4, 0), (1e-4, 1), (1e-3, 0), (1e-3, 1)] and not (tmp_path / "4").exists()


# --- real studies -------------------------------------------------------------------------------------

STUDY = [
    "-m", "hydra/sweeper=optuna", "hydra/launcher=local", "+override=lr_cosine", "trainer.steps=3",
    "trainer.batch_size=4", "logger=none", "checkpoint.every_steps=1", "backend.num_workers=1",  # 2 trials at a time
    "override.lr.value=tag(log,interval(1e-4,3e-3))", "override.lr.warmup_steps=int(interval(0,2))",
    "hydra.sweeper.n_trials=5", "hydra.sweeper.n_jobs=2",
]  # fmt: skip


def started_and_told(log_text: str) -> tuple[dict[int, int], set[int]]:
    """From a study's log: {trial: its job's pid} of every trial started, and the trials told (ended)."""
    started = {int(n): int(pid) for n, pid in re.findall(r"#(\d+) : .* \(job (\d+)\)", log_text)}
    return started, {int(n) for n in re.findall(r"(?:^|\] )trial (\d+)(?::| failed)", log_text, re.M)}


def test_a_study_killed_while_trials_run_continues_with_the_same_command(ray_address, tmp_path):
    """SIGKILL of the submitting process while two trials a < b (after the first two) run; a's job finishes
    meanwhile, b's is killed too (a node lost). The same command continues: a recorded from its run dir, b failed (cut
    off) and its point run first as a new trial in b's run dir (as job b: from its newest checkpoint, each step once),
    none run twice, new trials in new run dirs (never resuming another trial's checkpoint), 5 of 5 completed. With
    CMA-ES (the study's one real non-default sampler: random until 2 trials ended, then its generations, kept in
    the storage: trial 3 on, but for the continuation, whose point is b's)."""
    from tinker_exp.sweep.study import CONTINUES, job_number

    sweep = tmp_path / "study"
    sampler = ["hydra.sweeper.sampler=cmaes", "hydra.sweeper.n_startup_trials=2"]
    command = [sys.executable, "-m", "tinker_exp", *STUDY, *sampler, f"hydra.sweep.dir={sweep}"]
    env = environment({"RAY_ADDRESS": ray_address})
    log = tmp_path / "first.log"

    def two_later_trials_run() -> bool:
        started, told = started_and_told(log.read_text())
        running = sorted(set(started) - told)
        return len(running) == 2 and running[0] >= 2 and all(
            (sweep / str(n) / "job.json").exists() and read_objective(sweep / str(n)) is None for n in running
        )

    first = start_cli(*command[3:], env=env, output=log)
    try:
        while True:  # stopped (it asks and tells nothing more) while the condition holds, then killed
            wait_until(two_later_trials_run, 600, "two trials after the first two running at once", first)
            first.send_signal(signal.SIGSTOP)
            if two_later_trials_run():
                break
            first.send_signal(signal.SIGCONT)
        started, told = started_and_told(log.read_text())
        a, b = sorted(set(started) - told)
        trial_b = psutil.Process(started[b])
        for process in [trial_b, *trial_b.children(recursive=True)]:
            process.kill()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    psutil.wait_procs([psutil.Process(started[a])] if psutil.pid_exists(started[a]) else [], timeout=300)
    assert read_objective(sweep / str(a)) is not None and read_objective(sweep / str(b)) is None
    before = {n: job_json(sweep / str(n)) for n in started}
    kept = latest(sweep / str(b) / "checkpoints") if (sweep / str(b) / "checkpoints").is_dir() else None

    result = run_cli(*command[3:], env=env, timeout=900)
    out = result.stdout + result.stderr  # Hydra logs to stdout
    assert result.returncode == 0, out[-3000:]
    assert f"trial {a}: completed while the study was down" in out
    assert f"trial {b}: cut off while the study was down ({sweep / str(b)})" in out
    assert f"trial {b} (cut off): continued as trial {b + 1} at the same point, in {sweep / str(b)} from " in out
    assert sorted(started_and_told(out)[0]) == [b, *range(b + 2, 6)]  # b's point first (as job b), then new trials; none twice
    trials = storage_trials(sweep)
    assert [t.state for t in trials] == [TrialState.FAIL if t.number == b else TrialState.COMPLETE for t in trials]
    assert len(trials) == 6 and trials[a].value == read_objective(sweep / str(a))
    assert trials[b + 1].params == trials[b].params and trials[b + 1].user_attrs[CONTINUES] == b
    assert "sampler cmaes" in log.read_text()
    assert all(any(k.startswith("cma:") for k in t.system_attrs) for t in trials[3:] if CONTINUES not in t.user_attrs)
    for trial in trials:
        run_dir = sweep / str(job_number(trial))
        assert trial.user_attrs["run_dir"] == str(run_dir)
        if trial.number in before and trial.number != b:
            assert job_json(run_dir) == before[trial.number]  # not started again
        if trial.state == TrialState.COMPLETE:  # its own run, no other trial's checkpoint; b's, resumed: each step once
            rows = read_jsonl(run_dir / "metrics.jsonl")
            assert [row["train/step"] for row in rows] == [0, 1, 2] and rows[-1]["val/loss"] == trial.value
            assert job_json(run_dir)["num"] == job_number(trial)
            assert f"override.lr.value={trial.params['override.lr.value']!r}" in job_json(run_dir)["overrides"]
    assert not (sweep / str(b + 1)).exists()  # the continuation trained in b's run dir
    if kept is not None and kept.step < 3:  # b had saved a checkpoint before it was killed: its point resumed there
        assert f"resuming from {kept.path} at step {kept.step}" in (sweep / str(b) / "tinker_exp.log").read_text()
    values = [t.value for t in trials if t.state == TrialState.COMPLETE]
    saved = OmegaConf.load(sweep / "optimization_results.yaml")
    assert saved.best_value == min(values) and saved.n_complete == 5 and saved.n_trials == 5
    best = min((t for t in trials if t.value is not None), key=lambda t: t.value)
    assert saved.best_trial == best.number and f"best trial {best.number}: {best.value:.6g}" in out
    assert list(saved.failed) == [] and "failed trial" not in out
    assert [row["num"] for row in read_jsonl(sweep / "summary.jsonl")][0] == best.number
    assert math.isfinite(best.value) and (sweep / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_a_study_stopped_by_ctrl_c_then_sigterm_finishes_its_cut_off_trial_at_its_point_from_its_checkpoints(ray_address, tmp_path):
    """A LoRA study of 3 trials on 2 slots of one group (threads of the sweep's process). Ctrl-C once trials 0 and 1
    are told and trial 2 has saved a checkpoint: trial 2's run stops at its next step, the trial is failed without an
    error (cut off), exit 130 and the line that continues the study. That command continues it: trial 2's point runs
    again first, as trial 3, in trial 2's run dir, from its newest checkpoint (n_trials counts 0 and 1, not 2: no
    new point is asked); SIGTERM once it has saved a newer one: exit 143, its line. Its command finishes the point as
    trial 4 in the same run dir, again from its newest checkpoint: run dir 2's metrics.jsonl holds every step once
    and exit 0, the study's storage every trial as it ended (2 and 3 cut off, each continued by the next), its
    summary and results one completed row per point."""
    from tinker_exp.sweep.study import CONTINUES, JOB

    steps, every = 24, 4
    command = [
        sys.executable, "-m", "tinker_exp", "-m", "hydra/sweeper=optuna", "hydra/launcher=local", f"hydra.sweep.dir={tmp_path}",
        "lora=r8", "logger=none", f"trainer.steps={steps}", f"checkpoint.every_steps={every}", "hydra.launcher.slots=2",
        "optimizer.lr=tag(log,interval(1e-4,1e-3))", "hydra.sweeper.n_trials=3",
    ]  # fmt: skip
    env, run_2 = environment({"RAY_ADDRESS": ray_address}), tmp_path / "2"

    def told(log: Path) -> set[int]:
        return started_and_told(log.read_text())[1]

    def saved_after(step: int):  # a checkpoint of run dir 2 past `step`, its run still training
        def saved() -> bool:
            done = [int(m.parent.name.split("_")[1]) for m in (run_2 / "checkpoints").glob("step_*/MANIFEST.json")]
            return max(done, default=0) > step and not (run_2 / "objective.json").exists()
        return saved

    def interrupted(argv: list[str], log: Path, ready, sig: int) -> tuple[str, list[str]]:
        """The study run with `argv` until `ready`, then signalled: its output, and the command its last line gives."""
        # SIGINT as a terminal delivers it (a suite run under `&` inherits it ignored)
        driver = start_cli(*argv[3:], env=env, default_sigint=True, output=log)
        try:
            wait_until(ready, 600, f"the study did not reach its point to stop ({log.name})", driver)
            driver.send_signal(sig)
            driver.wait(timeout=120)
        finally:
            driver.kill()
        output = log.read_text()
        assert driver.returncode == (130 if sig == signal.SIGINT else 143) and "Traceback" not in output, output[-3000:]
        assert not (run_2 / "tinker_exp.lock").exists() and not (run_2 / "objective.json").exists()
        last = output.strip().splitlines()[-1]
        return last, [sys.executable, *shlex.split(last.split("continue it with: ")[1])[1:]]

    first = tmp_path / "first.log"
    line, again = interrupted(command, first, lambda: told(first) >= {0, 1} and saved_after(0)(), signal.SIGINT)
    assert line == "tinker_exp: interrupted (Ctrl-C); continue it with: python -m tinker_exp " + shlex.join(
        [*(a for a in command[3:] if not a.startswith("hydra.sweep.dir=")), f"hydra.sweep.dir={tmp_path}"])
    assert told(first) == {0, 1} and [t.state for t in storage_trials(tmp_path)] == [TrialState.COMPLETE] * 2 + [TrialState.FAIL]
    cut_at = max(int(m.parent.name.split("_")[1]) for m in (run_2 / "checkpoints").glob("step_*/MANIFEST.json"))

    second = tmp_path / "second.log"
    line, third = interrupted(again, second, saved_after(cut_at), signal.SIGTERM)
    output = second.read_text()
    assert "continuing study 'tinker_exp' (" in output and "2 of 3 trials done; 1 waiting trials run first" in output, output[-3000:]
    assert f"trial 2 (cut off): continued as trial 3 at the same point, in {run_2} from its checkpoint at step {cut_at}" in output
    assert line.startswith("tinker_exp: terminated (SIGTERM); continue it with: ") and third == again
    assert not (tmp_path / "3").exists() and not told(second)

    result = run_cli(*again[3:], env=env, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "trial 3 (cut off): continued as trial 4 at the same point, in " in out and "3 of 3 trials done" not in out
    trials = storage_trials(tmp_path)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2 + [TrialState.FAIL] * 2 + [TrialState.COMPLETE], [t.state for t in trials]
    assert [t.user_attrs.get("error") for t in trials[2:4]] == [None, None]  # cut off: no error of its own
    assert [(t.user_attrs[CONTINUES], t.user_attrs[JOB]) for t in trials[3:]] == [(2, 2), (3, 2)]
    assert trials[2].params == trials[3].params == trials[4].params and {t.user_attrs["run_dir"] for t in trials[2:]} == {str(run_2)}
    assert [row["train/step"] for row in read_jsonl(run_2 / "metrics.jsonl")] == list(range(steps))  # each step once, no gap
    starts = [int(step) for step in re.findall(r"resuming from \S+ at step (\d+)", (run_2 / "tinker_exp.log").read_text())]
    assert len(starts) == 2 and starts[0] == cut_at < starts[1] and starts[1] % every == 0, starts  # each from its checkpoint
    assert not any((tmp_path / str(n)).exists() for n in (3, 4))  # the continuations trained in run dir 2
    saved = OmegaConf.load(tmp_path / "optimization_results.yaml")
    assert (saved.n_trials, saved.n_complete, list(saved.failed)) == (3, 3, [])
    rows = read_jsonl(tmp_path / "summary.jsonl")
    assert sorted((row["num"], row["status"], row["run_dir"]) for row in rows) == [
        (0, "COMPLETED", str(tmp_path / "0")), (1, "COMPLETED", str(tmp_path / "1")), (4, "COMPLETED", str(run_2))]  # fmt: skip
    assert trials[4].value == read_objective(run_2) and "FAILED" not in (tmp_path / "summary.md").read_text()


def test_the_hparams_search_preset_on_the_slurm_launcher_searches_its_three_keys():
    """`-m hparams_search=lr_cosine hydra/launcher=slurm_local`: the command line's launcher wins over the preset's,
    and the sweeper searches the preset's keys (a real Slurm study: the pruning study below, one job per trial)."""
    hydra = compose("hparams_search=lr_cosine", "hydra/launcher=slurm_local", with_hydra=True).hydra
    assert hydra.launcher._target_.endswith("SlurmSweepLauncher") and hydra.sweeper._target_.endswith("OptunaSweeper")
    assert set(hydra.sweeper.params) == {"override.lr.value", "override.lr.warmup_steps", "override.lr.min_ratio"}


@pytest.mark.parametrize("server", [False, True], ids=["journal", "postgres"])
def test_a_pruning_study_stops_trials_at_the_evaluation_its_pruner_judges_and_records_them_pruned(ray_address, tmp_path, request, server):
    """The threshold pruner on the requested learning rate (override constant, so whether a trial must be pruned is
    known from its point): every trial above the threshold is pruned at its first evaluation (step 2 of 6), ends
    cleanly with a checkpoint there, and is PRUNED in the storage (the journal file, or a real PostgreSQL server
    the jobs report to) with the value it reported; the others run to the end. Storage, run dirs, summary and
    optimization_results.yaml agree; the server's password is in nothing printed or written. 2 trials at a time (a
    worker each): 3 on the journal, 2 on the server (what it adds is the storage); on the journal, with longer unpruned trials, no idle slot: trial 2 starts as soon as trial 1 is
    pruned, while trial 0 still trains (in batches it would wait for both)."""
    upper, steps = 2e-3, 6 if server else 60
    n_trials = 2 if server else 3  # the seeded sampler's first points: on the server one to prune, one to complete
    url = request.getfixturevalue("postgres_url") if server else None
    name = f"pruning-{tmp_path.name}-{os.getpid()}" if server else "tinker_exp"  # one server, many studies
    storage = [f"hydra.sweeper.storage={url}", f"hydra.sweeper.study_name={name}"] if server else []
    result = run_cli(
        "-m", "hydra/sweeper=optuna", "hydra/launcher=local", f"hydra.sweep.dir={tmp_path}", f"trainer.steps={steps}",
        "trainer.eval_every=2", "trainer.batch_size=4", "backend.num_workers=1", "logger=none", "trainer.objective=requested/lr",
        "+override=constant", "override.lr=tag(log,interval(1e-5,1e-1))", f"hydra.sweeper.n_trials={n_trials}", "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.pruner=threshold", f"+hydra.sweeper.pruner_args.upper={upper}", *storage,
        env={"RAY_ADDRESS": ray_address}, timeout=900,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    trials = optuna.load_study(study_name=name, storage=url).trials if server else storage_trials(tmp_path)
    assert len(trials) == n_trials
    if server:
        password = url.split(":")[2].split("@")[0]
        written = [p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".yaml", ".json", ".jsonl", ".md", ".log")]
        assert password not in out and not any(password in text for text in written)
        assert f"({url.replace(password, '***')})" in out and not list(tmp_path.glob("optuna.*"))
    pruned = [t for t in trials if t.params["override.lr"] > upper]
    assert pruned and len(pruned) < len(trials)  # the seeded sampler gives both kinds (else: another seed)
    saved = OmegaConf.load(tmp_path / "optimization_results.yaml")
    for trial in trials:
        run_dir = tmp_path / str(trial.number)
        rows = read_jsonl(run_dir / "metrics.jsonl")
        evaluated = {row["train/step"]: row["requested/lr"] for row in rows if "val/loss" in row}
        assert trial.intermediate_values == evaluated  # each evaluation reported at its train/step, nothing else
        last = latest(run_dir / "checkpoints")
        assert last.step == rows[-1]["train/step"] + 1  # a checkpoint where it stopped
        loop = last.state
        if trial in pruned:
            assert trial.state == TrialState.PRUNED and [row["train/step"] for row in rows] == [0, 1]
            assert trial.value == rows[-1]["requested/lr"] and loop["pruned"] is True
            job_log = (run_dir / "tinker_exp.log").read_text()
            assert f"pruned at step 2: requested/lr {trial.value:.6g}" in job_log
            assert f"trial {trial.number}: pruned at step 2: {trial.value:.6g}" in out
            assert read_json(run_dir / "objective.json")["pruned_at_step"] == 2
        else:
            assert trial.state == TrialState.COMPLETE and len(rows) == steps and "pruned" not in loop
    assert [(p.trial, p.step) for p in saved.pruned] == [(t.number, 2) for t in pruned]
    assert saved.n_pruned == len(pruned) and saved.best_value == min(t.value for t in trials if t not in pruned)
    assert saved.failed == [] and "cut off" not in (tmp_path / "summary.md").read_text()
    statuses = {row["num"]: row["status"] for row in read_jsonl(tmp_path / "summary.jsonl")}
    assert statuses == {t.number: "PRUNED" if t in pruned else "COMPLETED" for t in trials}
    trained = 2 * len(pruned) + steps * (len(trials) - len(pruned))
    assert (saved.steps_trained, saved.steps_without_pruning) == (trained, steps * len(trials))
    assert f"steps trained: {trained} ({trained / (len(trials) * steps):.0%}) of the {len(trials) * steps} a study without pruning would have trained" in out
    # Never more than n_jobs trials at once; each trial's job from its submission to its result (submitit's files).
    job_ids = {row["num"]: row["job_id"] for row in read_jsonl(tmp_path / "summary.jsonl")}
    job_files = {n: tmp_path / ".submitit" / job_id / job_id for n, job_id in job_ids.items()}
    ran = {n: (Path(f"{f}_submitted.pkl").stat().st_mtime, Path(f"{f}_0_result.pkl").stat().st_mtime) for n, f in job_files.items()}
    assert max(sum(start <= t < end for start, end in ran.values()) for t, _ in ran.values()) == 2, ran
    if not server:  # the seeded points: trials 1 and 2 pruned, 0 not
        assert [t in pruned for t in trials] == [False, True, True]
        assert trials[1].datetime_complete < trials[2].datetime_start < trials[0].datetime_complete  # asked at once
        assert ran[1][1] < ran[2][0] < ran[0][1], ran  # submitted after trial 1's job ended, before trial 0's did
        # Trial 2 judged beside both earlier trials (trial 1 may have been pruned before trial 0 reported step 1).
        median = statistics.median(t.intermediate_values[1] for t in trials[:2])
        assert f"(median of the other trials {median:.6g})" in (tmp_path / "2" / "tinker_exp.log").read_text()


def slurm_jobs_at_once(job_ids: list[str], slurm_env: dict) -> int:
    """The most of these jobs Slurm's accounting had in the queue at one time (submitted, not ended; one-second times)."""
    from datetime import datetime

    sacct = subprocess.run(
        ["sacct", "--jobs", ",".join(job_ids), "--allocations", "--noheader", "--parsable2", "--format", "JobID,Submit,End"],
        env=environment(slurm_env), capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    spans = {}
    for line in sacct.splitlines():  # a requeued job's last line is its newest start
        job_id, submit, end = line.split("|")
        spans[job_id] = (datetime.fromisoformat(submit), datetime.fromisoformat(end))
    assert sorted(spans) == sorted(job_ids), sacct
    return max(sum(start <= t < end for start, end in spans.values()) for t, _ in spans.values())


def test_a_pruning_study_on_the_local_slurm_cluster_keeps_n_jobs_in_the_queue_and_a_requeued_trial_reports_on(slurm_env, tmp_path):
    """Slurm jobs on both nodes report their evaluations to the journal in the sweep dir; the threshold pruner stops
    each trial above it at its first evaluation, as on the local launcher (the seeded sampler's first three points:
    trial 0 below the threshold, 1 and 2 above it). n_jobs=2: one sbatch per trial (no array), never more than 2 of
    the study's 3 jobs in the queue. Trial 0 (not pruned) gets the time-limit signal
    (USR2, what Slurm sends `signal_delay_s` before the limit) once it has reported an evaluation and saved a
    checkpoint: submitit requeues the job, which resumes from that checkpoint and reports its later evaluations to
    the same trial; the study records it once. (test_sweeps' sweep of 2-node points holds the other kind: a preemption.)"""
    upper, steps = 2e-3, 24
    command = [
        sys.executable, "-m", "tinker_exp", "-m", "hydra/sweeper=optuna", "hydra/launcher=slurm_local", f"hydra.sweep.dir={tmp_path}",
        f"trainer.steps={steps}", "trainer.eval_every=2", "checkpoint.every_steps=2", "trainer.batch_size=4", "logger=none",
        "backend.num_workers=1", "trainer.objective=requested/lr", "+override=constant", "override.lr=tag(log,interval(1e-5,1e-1))",
        "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=2", "hydra.sweeper.pruner=threshold", f"+hydra.sweeper.pruner_args.upper={upper}",
    ]  # fmt: skip
    slurm, log, run_0 = environment(slurm_env), tmp_path / "study.log", tmp_path / "0"

    def reported_and_saved() -> bool:  # trial 0: its first evaluation in the journal, a checkpoint after it
        saved = (run_0 / "checkpoints" / "step_00000002" / "MANIFEST.json").exists()
        return saved and bool(storage_trials(tmp_path)[0].intermediate_values)

    with open(log, "w") as out:
        driver = subprocess.Popen(command, cwd=REPO, env=slurm, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_until(reported_and_saved, 600, "trial 0 did not report an evaluation", driver)
            job_id = job_json(run_0)["slurm"]["job_id"]
            requeued_at = requeue_at_time_limit(slurm_env, job_id, job_id, driver)
            driver.wait(timeout=900)
        finally:
            driver.kill()
    output = log.read_text()
    assert driver.returncode == 0, output[-3000:]
    trials = storage_trials(tmp_path)
    assert [t.number for t in trials] == [0, 1, 2] and output.count("] trial 0: ") == 1  # trial 0 told once
    assert [t.params["override.lr"] > upper for t in trials] == [False, True, True]  # both kinds, as seeded
    jobs = {t.number: job_json(tmp_path / str(t.number))["slurm"] for t in trials}
    assert len({job["nodelist"] for job in jobs.values()}) == 2, jobs  # jobs on both nodes wrote to the one journal
    assert all("array_job_id" not in job for job in jobs.values())  # each trial its own sbatch
    assert slurm_jobs_at_once([job["job_id"] for job in jobs.values()], slurm_env) == 2  # n_jobs in the queue, never more
    assert {row["num"]: row["job_id"] for row in read_jsonl(tmp_path / "summary.jsonl")} == {n: job["job_id"] for n, job in jobs.items()}
    ids = [job["job_id"] for job in jobs.values()]  # what the sweeper polled: one squeue (and sacct) for them all
    assert slurm_states(ids, env=slurm) == dict.fromkeys(ids, "COMPLETED")  # pruned trials' jobs end cleanly too
    assert slurm_states(ids[:1], env=slurm) == {ids[0]: "COMPLETED"}  # one id gone: squeue fails
    saved = OmegaConf.load(tmp_path / "optimization_results.yaml")
    assert saved.failed == [] and os.path.samefile(saved.best_run_dir, tmp_path / str(saved.best_trial))
    for trial in trials:
        rows = read_jsonl(tmp_path / str(trial.number) / "metrics.jsonl")
        assert trial.intermediate_values == {row["train/step"]: row["requested/lr"] for row in rows if "val/loss" in row}
        must_prune = trial.params["override.lr"] > upper
        assert trial.state == (TrialState.PRUNED if must_prune else TrialState.COMPLETE)
        assert len(rows) == (2 if must_prune else steps)
    # Trial 0: a second start that resumed from a checkpoint (rows before it kept, each step once) and reported the
    # evaluations after it to the same trial.
    rows = read_jsonl(run_0 / "metrics.jsonl")
    assert jobs[0]["restart_count"] == "1" and [row["train/step"] for row in rows] == list(range(steps))
    resumed_at = next(row["train/step"] for row in rows if row["time"] > requeued_at)
    assert resumed_at >= 2 and resumed_at % 2 == 0  # a checkpoint's step (every 2), not step 0
    assert max(trials[0].intermediate_values) == steps - 1 and trials[0].value == rows[-1]["requested/lr"]
    assert len([line for line in (run_0 / "tinker_exp.log").read_text().splitlines() if "workers: " in line]) == 2
    # submitit's USR2 handler ran and requeued the job; its own "Requeued job" line may never be written: Slurm's
    # SIGTERM for that requeue can stop the process before submitit logs it. The first start ended by itself.
    job_log = read_job_log(tmp_path, jobs[0]["job_id"])
    assert "this job is preempted" in job_log and "Killed" not in job_log, job_log[-3000:]
