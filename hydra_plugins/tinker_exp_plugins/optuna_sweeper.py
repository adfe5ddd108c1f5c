"""A Hydra sweeper that runs an Optuna study (TPE, seeded) over tinker_exp runs, on any launcher.

Why our own and not hydra-optuna-sweeper: its newest release (1.3.0) pins optuna<3, whose SQLite storage fails
with SQLAlchemy 2, and a study must persist in its sweep dir so that the same command continues it. This one is
small: Hydra's override parser gives the search space (tinker_exp/sweep/study.py), Optuna >= 4 asks and tells.

Each batch: ask `n_jobs` trials, launch them as one batch of jobs (job number = trial number, so each trial has its
own run dir and never resumes another's checkpoint), tell each trial what its job returned, or FAIL when the job
failed; the study goes on. With a pruner (hydra.sweeper.pruner), each job is told its study through STUDY_ENV and
reports every evaluation to its trial; a job its pruner stopped ends cleanly and is told PRUNED. At the end: the best trial printed and written to optimization_results.yaml, the
failed trials named, a summary and report over every trial; exit 0 when at least one trial completed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from pathlib import Path
from typing import Any, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.tinker_exp_plugins.launchers import SweepFailedError, job_error, job_run_dir
from tinker_exp.errors import ConfigError, TinkerExpError
from tinker_exp.formats import read_json
from tinker_exp.sweep.jobs import JOB_FILE, read_outcome, summary_table, write_summary
from tinker_exp.sweep.report import REPORT, STUDY_REPORT, display_name, write_report, write_study_report
from tinker_exp.sweep.slurm import cancel_slurm_jobs
from tinker_exp.train.objective import read_objective, read_run_end

log = logging.getLogger(__name__)


class StudyFailedError(TinkerExpError):
    """No trial completed: the entry point prints the message and nothing else (no Hydra hint), exit status 1."""


class OptunaSweeper(Sweeper):
    def __init__(
        self,
        n_trials: int,
        n_jobs: int,
        seed: int,
        direction: str = "minimize",
        n_startup_trials: int = 10,
        study_name: str = "tinker_exp",
        storage: str | None = None,
        params: dict[str, str] | None = None,
        pruner: str = "none",
        pruner_args: dict[str, Any] | None = None,
    ) -> None:
        self.n_trials, self.n_jobs, self.seed, self.direction = n_trials, n_jobs, seed, direction
        self.n_startup_trials, self.study_name, self.storage = n_startup_trials, study_name, storage
        self.params = dict(params or {})
        self.pruner = pruner
        self.pruner_args = OmegaConf.to_container(pruner_args) if isinstance(pruner_args, DictConfig) else dict(pruner_args or {})

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        # Checked here, not in __init__: Hydra would wrap an error raised there in its own, over several lines.
        for key, least in (("n_trials", 1), ("n_jobs", 1), ("n_startup_trials", 0)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"hydra.sweeper.{key}: {value!r} must be an int >= {least}")
        if self.direction not in ("minimize", "maximize"):
            raise ConfigError(f"hydra.sweeper.direction: {self.direction!r} must be minimize or maximize")
        from tinker_exp.sweep.study import make_pruner

        self.optuna_pruner = make_pruner(self.pruner, self.pruner_args)
        if self.pruner != "none":
            trainer, data = config.trainer, config.data
            if data.get("val_path") is None and data.get("val_fraction") is None:
                raise ConfigError(f"hydra.sweeper.pruner={self.pruner}: the pruner needs evaluations, and there is no validation data (data.val_path or data.val_fraction)")
            if not trainer.eval_every:
                raise ConfigError(f"hydra.sweeper.pruner={self.pruner}: trainer.eval_every=0 evaluates only after the last step; the pruner has nothing to judge")
        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )
        if hasattr(self.launcher, "summarize"):  # ours: the study prints one line per trial and one summary
            self.launcher.summarize = False
            # A sampled point that fails the checks fails its trial without a job; the study goes on.
            self.launcher.refuse_bad_points = False

    def sweep(self, arguments: list[str]) -> Any:
        import optuna

        from tinker_exp.sweep.study import (
            RESULTS_FILE,
            STUDY_ENV,
            best_trial,
            finished,
            masked,
            open_storage,
            recover,
            results,
            search_space,
            steps_line,
            sweep_storage,
            trial_overrides,
        )

        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        fixed, space = search_space(parser.parse_overrides([f"{k}={v}" for k, v in self.params.items()] + arguments))
        if not space:
            raise ConfigError(
                "hydra.sweeper.params: no search space; give one in hydra.sweeper.params or on the command line, "
                "e.g. 'optimizer.lr=tag(log, interval(1e-5, 1e-3))'"
            )
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        # The storage URL's password is not written (the sweeper's node and Hydra's record of the command line).
        (sweep_dir / "multirun.yaml").write_text(masked(OmegaConf.to_yaml(self.config)))
        storage = self.storage or sweep_storage(sweep_dir)
        shown = masked(storage)
        if storage.startswith("sqlite:") and not self.storage:
            log.info(f"a study of an earlier version: its {shown} stays its storage (a new study gets a journal file)")

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own lines say what happens
        try:
            study = optuna.create_study(
                study_name=self.study_name, storage=open_storage(storage), direction=self.direction, load_if_exists=True,
                pruner=self.optuna_pruner,
            )  # fmt: skip
        except Exception as e:  # SQLAlchemy's errors (no server, a bad URL) carry the URL: said once, masked
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"hydra.sweeper.storage: {shown}: cannot open the study: {masked(why)[:300]}") from None
        if self.pruner != "none":  # each job reports to its trial (number = job number) through the same storage
            os.environ[STUDY_ENV] = json.dumps(
                {"storage": storage, "study_name": self.study_name, "pruner": self.pruner, "pruner_args": self.pruner_args}
            )
        with warnings.catch_warnings():  # constant_liar is "experimental": no warning on every study
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            # Seeded by the trials so far: a continued study does not replay the first trials' random points.
            study.sampler = optuna.samplers.TPESampler(
                seed=self.seed + len(study.trials), n_startup_trials=self.n_startup_trials, constant_liar=True
            )
        if study.trials:
            self._stop_cut_off_jobs(study)
            for line in recover(study):
                log.info(line)
            log.info(f"continuing study {self.study_name!r} ({shown}): {len(finished(study))} of {self.n_trials} trials done")
        else:
            log.info(f"study {self.study_name!r} ({shown}): {self.n_trials} trials, {self.n_jobs} at a time")
        log.info("search space: " + ", ".join(f"{k}: {d}" for k, d in space.items()))

        while len(finished(study)) < self.n_trials:
            trials = [study.ask(space) for _ in range(min(self.n_jobs, self.n_trials - len(finished(study))))]
            numbers = [t.number for t in trials]
            if numbers != list(range(numbers[0], numbers[0] + len(numbers))):  # another process asks too
                raise ConfigError(f"hydra.sweeper.storage: trials {numbers} are not consecutive; is another study running on {shown}?")
            batch = [trial_overrides(fixed, t.params) for t in trials]
            for trial, overrides in zip(trials, batch):
                trial.set_user_attr("overrides", overrides)
                trial.set_user_attr("run_dir", str(job_run_dir(self.hydra_context, self.config, overrides, trial.number)))
            try:
                self.validate_batch_is_legal(batch)
                returns = self._launch(batch, numbers[0])
            except BaseException:  # a compose error, Ctrl-C (the launcher cancelled the jobs): not left RUNNING
                for trial in trials:
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            for trial, ret in zip(trials, returns):
                value, error = trial_value(ret)
                pruned_at = read_run_end(Path(trial.user_attrs["run_dir"])).get("pruned_at_step")
                if error is None and pruned_at is not None:
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)  # its value: the last one it reported
                    log.info(f"trial {trial.number}: pruned at step {pruned_at}: {value:.6g}; {trial.user_attrs['run_dir']}")
                elif error is None:
                    study.tell(trial, value)
                    best = study.best_trial
                    log.info(f"trial {trial.number}: {value:.6g} (best: trial {best.number}, {best.value:.6g}); {trial.user_attrs['run_dir']}")
                else:
                    trial.set_user_attr("error", error)
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    log.warning(f"trial {trial.number} failed: {error}")

        summary = results(study, shown)
        OmegaConf.save(OmegaConf.create(summary), sweep_dir / RESULTS_FILE)
        self._write_summary(study, sweep_dir)
        for failed in summary["failed"]:
            log.warning(f"failed trial {failed['trial']} [{' '.join(failed['overrides'])}]: {failed['error']}")
        if self.pruner != "none":
            log.info(steps_line(summary))
        best = best_trial(study)
        if best is None:
            raise StudyFailedError(f"none of the {summary['n_trials']} trials completed; {sweep_dir / RESULTS_FILE}")
        log.info(
            f"best trial {best.number}: {best.value:.6g} with {' '.join(summary['best_overrides'])} "
            f"({summary['n_complete']} of {summary['n_trials']} trials completed); {sweep_dir / RESULTS_FILE}"
        )
        return summary

    def _launch(self, batch: Sequence[Sequence[str]], first: int) -> Sequence[JobReturn]:
        """The launcher's returns; our launchers raise at a failed job (right for a grid), a study goes on."""
        try:
            return self.launcher.launch(batch, initial_job_idx=first)
        except SweepFailedError as e:
            return e.returns

    def _stop_cut_off_jobs(self, study: Any) -> None:
        """Slurm jobs of trials a killed study left running, not completed, are cancelled: those trials are
        marked failed (`recover`), so nothing of theirs may run on."""
        from tinker_exp.sweep.study import running, trial_run_dir

        ids = []
        for trial in running(study):
            run_dir = trial_run_dir(trial)
            slurm = None if run_dir is None else (read_json(run_dir / JOB_FILE) or {}).get("slurm")
            if slurm and slurm.get("job_id") and read_objective(run_dir) is None:
                ids.append(slurm["job_id"])
        if ids and cancel_slurm_jobs(ids):
            log.info(f"cancelled Slurm jobs {', '.join(ids)} of trials cut off")

    def _write_summary(self, study: Any, sweep_dir: Path) -> None:
        """summary.md/jsonl and report.png over every trial of the study (a continued study's earlier ones too),
        each labelled by its searched values."""
        from optuna.trial import TrialState

        from tinker_exp.sweep.study import trial_error, trial_label, trial_run_dir

        outcomes = []
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)):
            run_dir = trial_run_dir(t) or sweep_dir / str(t.number)
            status = {TrialState.COMPLETE: "COMPLETED", TrialState.PRUNED: "PRUNED"}.get(t.state, "FAILED")
            outcomes.append(read_outcome(t.number, [trial_label(t.params)], status, run_dir, trial_error(t), None, t.value))
        summary = write_summary(sweep_dir, outcomes)
        # Each labelled by what differs; a pruned trial's curve ends where it stopped, and says so.
        runs = [(f"trial {o.num}" + (f" (pruned at {o.steps})" if o.status == "PRUNED" else ""), Path(o.run_dir)) for o in outcomes]
        report = write_report(runs, sweep_dir / REPORT, f"study {display_name(sweep_dir)}")
        slices = write_study_report(study, sweep_dir / STUDY_REPORT, f"study {display_name(sweep_dir)}")
        log.info(f"study summary ({', '.join(str(p) for p in (summary, report, slices) if p)}):\n{summary_table(outcomes)}")


def trial_value(ret: JobReturn) -> tuple[float | None, str | None]:
    """(the value to tell, None) for a job that completed with a finite objective, else (None, why it failed)."""
    if ret.status != JobStatus.COMPLETED:
        return None, job_error(ret)
    value = ret.return_value
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return None, f"the run returned no finite objective ({value!r})"
    return float(value), None
