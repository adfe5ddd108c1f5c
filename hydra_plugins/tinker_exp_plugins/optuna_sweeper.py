"""A Hydra sweeper that runs an Optuna study over tinker_exp runs, on any launcher.

The study: TPE by default; gp, cmaes, random, grid; seeded.

Why our own and not hydra-optuna-sweeper: its newest release (1.3.0) pins optuna<3, whose SQLite storage fails
with SQLAlchemy 2, and a study must persist in its sweep dir so that the same command continues it. This one is
small: Hydra's override parser gives the search space (tinker_exp/sweep/study.py), Optuna 5 asks and tells.

No idle slots: `n_jobs` trials run at all times (fewer where the local launcher runs fewer at once); as soon as
one ends, the study is told (its value, PRUNED, or FAIL) and the next trial is asked and started, through the
launcher's streaming calls (`SweepLauncher.start`/`wait_any`). Job number = trial number, so each trial has its
own run dir and never resumes another's checkpoint; but a trial cut off by the study's stop (Ctrl-C, SIGTERM, a
kill) is continued by the same command: its point enqueued again, asked first, run as its job, in its run dir,
from its checkpoint (tinker_exp/sweep/study.py `continue_cut_off`). With a pruner (hydra.sweeper.pruner), each job is told its
study through STUDY_ENV and reports every evaluation to its trial; a job its pruner stopped ends cleanly and is
told PRUNED. At the end: the best trial printed and written to optimization_results.yaml, the failed trials named,
a summary and report over every trial; exit 0 when at least one trial completed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.tinker_exp_plugins.launchers import (
    OneAtATime,
    SweepLauncher,
    continue_line,
    job_objective,
    job_run_dir,
    nothing_left_unsubmitted,
    save_multirun,
)
from tinker_exp import threads
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
        direction: str | None = None,
        n_startup_trials: int = 10,
        study_name: str = "tinker_exp",
        storage: str | None = None,
        params: dict[str, str] | None = None,
        pruner: str = "none",
        pruner_args: dict[str, Any] | None = None,
        sampler: str = "tpe",
        sampler_args: dict[str, Any] | None = None,
    ) -> None:
        self.n_trials, self.n_jobs, self.seed, self.direction = n_trials, n_jobs, seed, direction
        self.n_startup_trials, self.study_name, self.storage = n_startup_trials, study_name, storage
        self.params = dict(params or {})
        self.dry_run = False  # set from the config when the sweep starts
        self.pruner = pruner
        self.pruner_args = OmegaConf.to_container(pruner_args) if isinstance(pruner_args, DictConfig) else dict(pruner_args or {})
        self.sampler = str(sampler)
        self.sampler_args = OmegaConf.to_container(sampler_args) if isinstance(sampler_args, DictConfig) else dict(sampler_args or {})

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        # Checked here, not in __init__: Hydra would wrap an error raised there in its own, over several lines.
        for key, least in (("n_trials", 1), ("n_jobs", 1), ("n_startup_trials", 0)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"hydra.sweeper.{key}: {value!r} must be an int >= {least}")
        from tinker_exp.sweep.study import evaluations_error, make_pruner, study_direction

        from tinker_exp.train.objective import objective_metric

        self.direction = study_direction(self.direction, objective_metric(config), config.trainer.objective_mode)
        self.optuna_pruner = make_pruner(self.pruner, self.pruner_args)
        if self.pruner != "none" and (why := evaluations_error(self.pruner, config)):
            raise ConfigError(why)
        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )
        if isinstance(self.launcher, SweepLauncher):  # ours: the study prints one line per trial and one summary
            # A sampled point that fails the checks fails its trial without a job; the study goes on.
            self.launcher.refuse_bad_points = False
        self.jobs = self.launcher if isinstance(self.launcher, SweepLauncher) else OneAtATime(self.launcher)

    def sweep(self, arguments: list[str]) -> Any:
        import optuna

        from tinker_exp.sweep.study import (
            RESULTS_FILE,
            STUDY_ENV,
            best_trial,
            grid_size,
            make_sampler,
            masked,
            open_storage,
            recover,
            results,
            search_space,
            settled,
            startup_note,
            steps_line,
            sweep_storage,
        )

        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        fixed, space = search_space(parser.parse_overrides([f"{k}={v}" for k, v in self.params.items()] + arguments))
        if not space:
            raise ConfigError(
                "hydra.sweeper.params: no search space; give one in hydra.sweeper.params or on the command line, "
                "e.g. 'optimizer.lr=tag(log, interval(1e-5, 1e-3))'"
            )
        make_sampler(self.sampler, self.sampler_args, space, self.seed, self.n_startup_trials)  # refused before anything is written
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        self._refuse_before_writing(fixed, space, sweep_dir)
        made_now = not sweep_dir.exists()
        sweep_dir.mkdir(parents=True, exist_ok=True)  # a study's default storage is a file in it
        self.dry_run = bool(self.config.get("dry_run"))
        storage = self.storage or sweep_storage(sweep_dir)
        shown = masked(storage)
        if self.dry_run:  # each trial's point planned by its job; nothing trained, so nothing for a study to keep
            storage, shown = None, "in memory: a dry run records no trial"
        elif storage.startswith("sqlite:") and not self.storage:
            log.info(f"a study of an earlier version: its {shown} stays its storage (a new study gets a journal file)")

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own lines say what happens
        try:
            study = optuna.create_study(
                study_name=self.study_name, storage=storage and open_storage(storage), direction=self.direction, load_if_exists=True,
                pruner=self.optuna_pruner,
            )  # fmt: skip
        except Exception as e:  # SQLAlchemy's errors (no server, a bad URL) carry the URL: said once, masked
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            if made_now:  # refused: the sweep leaves nothing behind
                shutil.rmtree(sweep_dir, ignore_errors=True)
            raise ConfigError(f"hydra.sweeper.storage: {shown}: cannot open the study: {masked(why)[:300]}") from None
        save_multirun(self.config, sweep_dir)  # accepted; the storage URL's password not written
        if self.pruner != "none" and not self.dry_run:  # each job reports to its trial (number = job number) through the same storage
            os.environ[STUDY_ENV] = json.dumps(
                {"storage": storage, "study_name": self.study_name, "pruner": self.pruner, "pruner_args": self.pruner_args}
            )
        # Seeded by the trials so far: a continued study does not replay the first trials' random points.
        study.sampler = make_sampler(self.sampler, self.sampler_args, space, self.seed + len(study.trials), self.n_startup_trials)
        if self.sampler == "grid" and self.n_trials > grid_size(space):  # past it, GridSampler would sample points again
            log.info(f"grid of {grid_size(space)} points: the study runs {grid_size(space)} trials, not {self.n_trials}")
            self.n_trials = grid_size(space)
        if isinstance(self.launcher, SweepLauncher) and not self._workers():  # a study worker decides in its job
            self.launcher.decide_study_slots(fixed, self.n_trials - len(settled(study)), space)
        if study.trials:
            self._stop_cut_off_jobs(study)
            for line in recover(study, keep_waiting=bool(self._workers())):
                log.info(line)
            waiting = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)))
            log.info(f"continuing study {self.study_name!r} ({shown}): {len(settled(study))} of {self.n_trials} trials done"
                     + (f"; {waiting} waiting trials run first" if waiting else ""))  # fmt: skip
        else:
            at_once = f"on {self._workers()} worker jobs" if self._workers() else f"{self._at_once()} at a time"
            startup = startup_note(self.sampler, self.n_startup_trials, self.n_trials)
            log.info(f"study {self.study_name!r} ({shown}): {self.n_trials} trials, {at_once}, sampler {self.sampler}{startup}")
        log.info("search space: " + ", ".join(f"{k}: {d}" for k, d in space.items()))

        with nothing_left_unsubmitted(sweep_dir, made_now):  # sbatch took no job: as if refused before writing
            if self._workers():
                self._run_workers(study, StudyWorker(self.launcher, self, storage, space, fixed, len(study.trials)), sweep_dir)
            else:
                self._run_trials(study, space, fixed, shown)
                self.jobs.end_slots()
        if self.dry_run:
            return self._end_dry_run(study, sweep_dir)
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

    def _refuse_before_writing(self, fixed: list[str], space: dict[str, Any], sweep_dir: Path) -> None:
        """What no trial of the study could get past, refused before anything is written.

        Slots none of its points can take (as a grid's are), and a storage that its workers, or its jobs reporting to
        their trials, cannot open."""
        from tinker_exp.sweep.study import unreachable_storage

        ours = isinstance(self.launcher, SweepLauncher)
        if ours:
            self.launcher.check_study_points(fixed, list(space))
        if self.config.get("dry_run"):  # its study is in memory, and nothing reports to it
            return
        workers = self.launcher.workers() if ours else 0
        opened_by = (f"the study's worker jobs (hydra.launcher.workers={workers})" if workers else
                     f"the trials' jobs (they report to it for hydra.sweeper.pruner={self.pruner})" if self.pruner != "none" else None)  # fmt: skip
        on_slurm = ours and self.launcher._EXECUTOR == "slurm"
        if opened_by and (why := unreachable_storage(self.storage, sweep_dir, opened_by, on_slurm)):
            raise ConfigError(why)

    def _end_dry_run(self, study: Any, sweep_dir: Path) -> dict[str, Any]:
        """A dry run's end: each trial's job planned its point (plan.json in its run dir), or failed it, named."""
        failed = [t for t in study.trials if "error" in t.user_attrs]
        for t in failed:
            log.warning(f"failed trial {t.number} [{' '.join(t.user_attrs['overrides'])}]: {t.user_attrs['error']}")
        if failed:
            raise StudyFailedError(f"dry run: {len(failed)} of {len(study.trials)} trials failed their checks; nothing trained")
        log.info(f"dry run: {len(study.trials)} trials planned in {sweep_dir}; nothing trained")
        return {}

    def _workers(self) -> int:
        """Study worker jobs (hydra.launcher.workers on Slurm); 0: a job per trial.

        A dry run keeps a job per trial: its study is in memory, where no worker can ask it."""
        return 0 if self.dry_run or not isinstance(self.launcher, SweepLauncher) else self.launcher.workers()

    def _run_workers(self, study: Any, worker: "StudyWorker", sweep_dir: Path) -> None:
        """The study on its worker jobs (`run_workers`), each trial's end said as the storage shows it."""
        run_workers(self.launcher, study, worker, self._workers(), self.n_trials, sweep_dir,
                    lambda trial: finished_line(study, trial), "study workers", "each runs trials one after another on warm workers")  # fmt: skip

    def _at_once(self) -> int:
        """Trials kept running: n_jobs, or fewer where the launcher runs fewer at once.

        Local: max_parallel; with slots, as many as the slots (the launcher's capacity)."""
        if isinstance(self.launcher, SweepLauncher) and self.launcher.slots() > 1:
            return self.launcher.capacity(self.config) or 1
        return min(self.n_jobs, self.jobs.capacity(self.config) or self.n_jobs)

    def _run_trials(self, study: Any, space: dict[str, Any], fixed: list[str], shown: str) -> None:
        """Keep `_at_once()` trials running until n_trials have finished and count (`settled`).

        As soon as one ends (completes, fails or is pruned) it is told and the next one asked and started, so no slot
        waits for a slower trial. Trials waiting (a cut-off trial's continuation) are asked first. Ctrl-C (or any
        error): the running trials' jobs are cancelled and the trials failed (cut off: the same command continues
        them), then it is raised."""
        import optuna

        from tinker_exp.sweep.study import finished, settled, trial_point

        at_once, next_number = self._at_once(), len(study.trials)
        on_slots = isinstance(self.launcher, SweepLauncher) and self.launcher.slots() > 1
        counted = finished if self.dry_run else settled  # a dry run's planned trials fail without an error: none is cut off
        running: dict[Any, Any] = {}  # the launcher's handle -> its trial
        asked = None  # a trial asked and not started yet
        warming = self.dry_run  # a dry run draws no summary
        try:
            while True:
                while len(running) < at_once and len(counted(study)) + len(running) < self.n_trials:
                    waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
                    expected = waiting[0].number if waiting else next_number  # Optuna asks the first waiting trial first
                    asked = study.ask(space)
                    if asked.number != expected:  # trial numbers are job numbers: no other process may ask
                        raise ConfigError(
                            f"hydra.sweeper.storage: trial {asked.number} was asked where trial {expected} was due; "
                            f"is another study running on {shown}?"
                        )
                    next_number += not waiting
                    overrides, num = trial_point(asked, fixed)
                    asked.set_user_attr("overrides", overrides)
                    if not on_slots:  # a job on a slot is composed as it starts (slot_jobs.py `prepare`): once, not thrice
                        self.validate_batch_is_legal([overrides])
                    handle = self.jobs.start(overrides, num)
                    asked.set_user_attr("run_dir", str(job_run_dir(self.hydra_context, self.config, overrides, num)))
                    running[handle] = asked
                    asked = None
                if not running:
                    return
                if not warming:  # once its first trials run: the summary's pictures at the end do not pay for it
                    from tinker_exp.sweep.report import warm_up

                    warming = True
                    threading.Thread(target=warm_up, name="report-warm-up", daemon=True).start()
                for handle, ret, outcome in self.jobs.wait_any(list(running)):
                    trial = running.pop(handle)
                    if outcome is not None and outcome.job_id:  # the summary's job id column
                        trial.set_user_attr("job_id", outcome.job_id)
                    self._tell(study, trial, ret)
        except BaseException as e:  # Ctrl-C, a compose error: the jobs cancelled, no trial left RUNNING
            self.jobs.cancel_running()
            for trial in [*running.values(), *([asked] if asked is not None else [])]:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            if isinstance(e, KeyboardInterrupt) and not str(e):  # the entry point prints the line that continues it
                raise KeyboardInterrupt(continue_line(str(self.config.hydra.sweep.dir))) from None
            raise

    def _tell(self, study: Any, trial: Any, ret: JobReturn) -> None:
        """The study learns what the trial's job came to; one log line."""
        import optuna

        if self.dry_run and ret.status == JobStatus.COMPLETED:  # planned: no value, and the study is in memory
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            log.info(f"trial {trial.number}: planned; {trial.user_attrs['run_dir']}")
            return
        tell(study, trial, ret)
        finished_line(study, study._storage.get_trial(trial._trial_id))

    def _stop_cut_off_jobs(self, study: Any) -> None:
        """Cancel the Slurm jobs of trials a killed study left running, not completed, and wait for them to leave.

        Those trials are marked failed, cut off, and continued in their run dirs (`recover`), where nothing of theirs
        may run on; so the study goes on once those jobs have left the queue (bounded: a run still holding its run
        dir then refuses its continuation with why)."""
        from tinker_exp.sweep.slurm import LEAVE_QUEUE_S, left_queue
        from tinker_exp.sweep.study import running, trial_run_dir

        ids = []
        for trial in running(study):
            run_dir = trial_run_dir(trial)
            slurm = None if run_dir is None else (read_json(run_dir / JOB_FILE) or {}).get("slurm")
            if slurm and slurm.get("job_id") and read_objective(run_dir) is None:
                ids.append(slurm["job_id"])
        if ids and cancel_slurm_jobs(ids):
            log.info(f"cancelled Slurm jobs {', '.join(ids)} of trials cut off")
            if still := left_queue(ids):
                log.warning(f"Slurm jobs {', '.join(still)} still in the queue {LEAVE_QUEUE_S:.0f} s after their scancel; check squeue")

    def _write_summary(self, study: Any, sweep_dir: Path) -> None:
        """summary.md/jsonl and report.png over every trial of the study, each labelled by its searched values.

        A continued study's earlier trials too; a cut-off trial that another continued is no row of its own (its
        point's row is the continuation's, in the same run dir)."""
        from optuna.trial import TrialState

        from tinker_exp.sweep.study import CONTINUES, job_number, superseded, trial_error, trial_label, trial_run_dir

        outcomes, gone = [], superseded(study.get_trials(deepcopy=False))
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)):
            if t.number in gone:
                continue
            run_dir = trial_run_dir(t) or sweep_dir / str(job_number(t))
            status = {TrialState.COMPLETE: "COMPLETED", TrialState.PRUNED: "PRUNED"}.get(t.state, "FAILED")
            outcomes.append(
                read_outcome(t.number, [trial_label(t.params)], status, run_dir, trial_error(t), t.user_attrs.get("job_id"), t.value)
            )
        summary = write_summary(sweep_dir, outcomes)
        # Each labelled by what differs; a pruned trial's curve ends where it stopped, and says so (a run that did not
        # complete says so by itself: report.py `ended_early`).
        by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
        runs = []
        for o in outcomes:
            first = by_number[o.num].user_attrs.get(CONTINUES)
            name = f"trial {o.num}" + (f" (continues trial {first})" if first is not None else "")
            runs.append((name + (f" (pruned after {o.steps} steps)" if o.status == "PRUNED" else ""), Path(o.run_dir)))
        report = write_report(runs, sweep_dir / REPORT, f"study {display_name(sweep_dir)}")
        slices = write_study_report(study, sweep_dir / STUDY_REPORT, f"study {display_name(sweep_dir)}")
        log.info(f"study summary ({', '.join(str(p) for p in (summary, report, slices) if p)}):\n{summary_table(outcomes)}")



def run_workers(launcher: SweepLauncher, study: Any, worker: "StudyWorker", count: int, n_trials: int, sweep_dir: Path,
                say: Callable[[Any], None], who: str, what: str, label: Callable[[Any], str] | None = None) -> None:  # fmt: skip
    """Submit `count` worker jobs (one sbatch) and wait until the study has its n_trials, saying each trial's end.

    Each trial's end as the storage shows it (`say`), until the study has its n_trials (a population's ledger: its
    members). A trial whose worker is gone (its job ended, or not seen for STALE_S) is failed and retried here
    (tinker_exp.sweep.workers.lose; `label` names it in the line). Every worker ended: the study stops where it is (the
    same command continues it). Ctrl-C (or any error): the running trials failed (cut off) and no new one asked
    (`stop_workers`), then every worker job cancelled (one scancel). `who`, `what`: the line that names the jobs."""
    from hydra_plugins.tinker_exp_plugins.launchers import POLL_S, cancel, sigint_deferred
    from tinker_exp.sweep.slurm import ACTIVE_STATES, Settling, slurm_states
    from tinker_exp.sweep.study import finished, running
    from tinker_exp.sweep.workers import STOPPED_ATTR, lose, lost, settled, stop_workers

    study._storage.set_study_system_attr(study._study_id, STOPPED_ATTR, False)  # a continued study's workers ask again
    jobs = launcher.submit_workers(worker, count)
    ids = [job.job_id for job in jobs]
    log.info(f"{who}: {count} Slurm jobs ({', '.join(ids)}), {what}")
    said = {t.number for t in finished(study)}
    settling = {job_id: Settling() for job_id in ids}
    # Ctrl-C noted, and raised at the top of a pass: a KeyboardInterrupt raised wherever the signal lands can fall
    # in a weakref callback or a __del__, where Python prints it and goes on (seen: the study then ran to its end).
    with sigint_deferred() as interrupted:
        try:
            while True:
                if interrupted():
                    raise KeyboardInterrupt
                states = slurm_states(ids)
                over = {job.job_id for job in jobs if states[job.job_id] not in ACTIVE_STATES and job.paths.result_pickle.exists()}
                ended = {i: v for i in ids if i not in over and (v := settling[i].verdict(states[i])) is not None}
                for trial, why in lost(running(study), ended, time.time()):
                    log.warning(lose(study, trial, why, sweep_dir, label=label))
                for trial in finished(study):
                    if trial.number not in said:
                        said.add(trial.number)
                        say(trial)
                if len(settled(study)) >= n_trials and not running(study):
                    break
                if len(over) + len(ended) == len(ids):
                    log.warning(
                        f"{who}: all {count} ended with {len(settled(study))} of {n_trials} trials done "
                        f"({', '.join(f'{i} {states[i]}' for i in ids)}); {continue_line(sweep_dir)}"
                    )
                    break
                time.sleep(POLL_S)
            workers_ended(jobs)
        except BaseException as e:
            stop_workers(study, sweep_dir)  # the running trials cut off, no new one asked; then the workers cancelled
            cancel(jobs)
            if isinstance(e, KeyboardInterrupt) and not str(e):
                raise KeyboardInterrupt(continue_line(str(sweep_dir))) from None
            raise


def workers_ended(jobs: list[Any], wait_s: float = 60.0) -> None:
    """Wait (bounded) for the worker jobs to end on their own once the study has its trials.

    Any still in the queue after `wait_s` is cancelled, so that a sweep leaves nothing behind."""
    from hydra_plugins.tinker_exp_plugins.launchers import POLL_S
    from tinker_exp.sweep.slurm import ACTIVE_STATES, slurm_states

    deadline = time.monotonic() + wait_s
    while True:
        states = slurm_states([job.job_id for job in jobs])
        left = [job for job in jobs if states[job.job_id] in ACTIVE_STATES]
        if not left:
            return
        if time.monotonic() > deadline:
            ids = [job.job_id for job in left]
            done = cancel_slurm_jobs(ids)
            log.warning(f"workers {', '.join(ids)} still in the queue {wait_s:.0f} s after the study ended: " + ("cancelled" if done else "scancel did not answer; check squeue"))
            return
        time.sleep(POLL_S)


def tell(study: Any, trial: Any, ret: JobReturn) -> None:
    """The study learns what the trial's run came to (in its job, or in a study worker).

    Its objective, PRUNED (its value: the last one it reported), or FAIL with why."""
    import optuna

    value, error = job_objective(ret)
    pruned_at = read_run_end(Path(trial.user_attrs["run_dir"])).get("pruned_at_step")
    if error is None and pruned_at is not None:
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    elif error is None:
        study.tell(trial, value)
    else:
        trial.set_user_attr("error", error)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)


def finished_line(study: Any, trial: Any) -> None:
    """One log line for a trial the study has been told of.

    Its value and the best so far, where it was pruned, or why it failed."""
    from optuna.trial import TrialState

    from tinker_exp.sweep.study import trial_error

    run_dir = trial.user_attrs.get("run_dir")
    if trial.state == TrialState.PRUNED:
        pruned_at = read_run_end(Path(run_dir)).get("pruned_at_step") if run_dir else None
        log.info(f"trial {trial.number}: pruned at step {pruned_at}: {trial.value:.6g}; {run_dir}")
    elif trial.state == TrialState.COMPLETE:
        best = study.best_trial
        log.info(f"trial {trial.number}: {trial.value:.6g} (best: trial {best.number}, {best.value:.6g}); {run_dir}")
    else:
        log.warning(f"trial {trial.number} failed: {trial_error(trial)}")


def worker_log() -> logging.Logger:
    """A study worker's own lines, to its job's log (stderr) only.

    Hydra configures logging anew for each trial and leaves the trial's log file as a handler of the root logger, which
    the next lines must not reach."""
    said = logging.getLogger("tinker_exp.study_worker")
    if not said.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(threads.RUN_LOG_FORMAT))
        said.addHandler(handler)
        said.setLevel(logging.INFO)
        said.propagate = False
    return said


class StudyWorker:
    """A study worker job's work: warm workers started once, then the study's trials run one after another.

    submitit pickles it to each job; job i calls it with i. Warm workers are started once in its allocation (a pool,
    when the trials' backend.pool is auto), then trials taken from the study's storage and run one after another, each
    as its own job would run it (`SweepLauncher.__call__`: its run dir, job number = trial number, its files), until the
    study has its n_trials (tinker_exp.sweep.workers)."""

    def __init__(
        self, launcher: SweepLauncher, sweeper: "OptunaSweeper", storage: str, space: dict[str, Any], fixed: list[str], seed_offset: int
    ) -> None:
        from hydra.core.singleton import Singleton

        self.launcher, self.storage, self.space, self.fixed = launcher, storage, space, fixed
        self.study_name, self.n_trials = sweeper.study_name, sweeper.n_trials
        self.sampler, self.sampler_args, self.n_startup_trials = sweeper.sampler, sweeper.sampler_args, sweeper.n_startup_trials
        # As the sweeper seeds its sampler: by the trials so far (a continued study does not replay earlier points).
        self.seed = sweeper.seed + seed_offset
        self.singleton_state = Singleton.get_state()  # Hydra's state, as each job of the launcher gets it

    def __call__(self, index: int) -> int:
        import optuna
        import submitit
        from hydra.core.singleton import Singleton

        from tinker_exp.place.pools import SweepPools
        from tinker_exp.sweep.study import open_storage
        from tinker_exp.sweep.workers import Heartbeat, resumed, work

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        said = worker_log()
        worker = submitit.JobEnvironment().job_id
        sweep_dir = Path(str(self.launcher.config.hydra.sweep.dir))
        study = optuna.load_study(study_name=self.study_name, storage=open_storage(self.storage))
        pools = SweepPools()  # this allocation's warm workers: started at the first trial that trains on a pool

        Singleton.set_state(self.singleton_state)  # the trials' configs are composed here, as a job's are
        self.launcher.decide_study_slots(self.fixed, self.n_trials, self.space)  # auto: from this node's memory
        slots = self.launcher.worker_slots()
        slot_jobs = self._slot_jobs(slots) if slots > 1 else None
        composing = threading.Lock()  # with slots, trials start from several threads; Hydra's config loader is one

        stopping = threading.Event()  # the worker's job ends (requeued, cancelled): its loops take no new trial

        def run(trial: Any) -> None:
            with composing:
                overrides, num, name = self.point(study, trial)
                trial.set_user_attr("overrides", overrides)
                trial.set_user_attr("run_dir", str(job_run_dir(self.launcher.hydra_context, self.launcher.config, overrides, num)))
                trial.set_user_attr("job_id", worker)
                said.info(f"{self.who} {worker}: {name}: {' '.join(overrides)}")
                args = (overrides, "hydra.sweep.dir", num, f"job_id_for_{num}", self.singleton_state)
                job = slot_jobs and slot_jobs.submit(self.launcher, *args)
            if job is None:
                self._keep_pool(pools, overrides)
                ret = self.launcher(*args)
            else:
                job.wait()
                ret = slot_return(job, overrides, stopping.is_set())
                if ret is None:
                    said.info(f"{self.who} {worker}: {name} stopped with this worker; left running, its own (a requeued worker takes it back)")
                    return
            try:
                tell(study, trial, ret)
            except (optuna.exceptions.UpdateFinishedTrialError, ValueError):  # Optuna's "Cannot tell a FAIL trial" too
                if not study._storage.get_trial(trial._trial_id).state.is_finished():
                    raise
                # the sweep failed it meanwhile: lost (retried), or cut off by the sweep's stop (continued)
                said.warning(f"{self.who} {worker}: {name} was failed by the sweep meanwhile (lost, or cut off by its stop)")

        def trials_of(taken_back: list[Any]) -> int:
            """One loop of the worker: the trials taken back first, then the study's until it has its n_trials."""
            for trial in taken_back:
                with Heartbeat(trial):
                    run(trial)
            return len(taken_back) + work(study, self.n_trials, lambda: self.ask(study), run, worker, sweep_dir, stopping=stopping.is_set)

        try:
            taken_back = resumed(study, worker)  # this job requeued (time limit, preemption): its trials go on
            for trial in taken_back:
                said.info(f"{self.who} {worker}: requeued; {self.point(study, trial)[2]} resumes in its run dir")
            if slot_jobs is None:
                ran = trials_of(taken_back)
            else:  # a loop a slot, at once (the study's ask lock orders their asks)
                ran = sum(at_once([lambda i=i: trials_of(taken_back[i::slots]) for i in range(slots)]))
        finally:
            stopping.set()  # before the slots close: their trials stopped now are the worker's stop, not theirs
            pools.close()
            if slot_jobs is not None:
                slot_jobs.close()
        said.info(f"{self.who} {worker}: all {self.n_trials} {self.items} are done or running elsewhere; this worker ran {ran}")
        return ran

    who, items = "study worker", "trials"
    """How its lines name the worker, and what it runs."""

    def ask(self, study: Any) -> Any:
        """A new trial of the study (`take` asks it under the workers' lock, a retry waiting first)."""
        from tinker_exp.sweep.study import make_sampler

        # Seeded by the trial's number (asked under the workers' lock): which worker asks does not change what a random
        # (or a sampler's startup) trial gets, and no two workers draw from the same seed. A grid keeps the sweep's
        # seed (its order of points; trial k gets point k, as a job-per-trial study's trial k does).
        seed = self.seed if self.sampler == "grid" else self.seed + len(study.trials)
        study.sampler = make_sampler(self.sampler, self.sampler_args, self.space, seed, self.n_startup_trials)
        return study.ask(self.space)

    def point(self, study: Any, trial: Any) -> tuple[list[str], int, str]:
        """(the overrides the trial runs with, its job number, its name in lines).

        A retry starts where the lost trial left off (`retry_start`); job number = trial number, but for a cut-off
        trial's continuation, which runs as that trial's job, with its overrides (`trial_point`: it resumes in its run
        dir)."""
        from tinker_exp.sweep.study import trial_point
        from tinker_exp.sweep.workers import retry_start

        overrides, num = trial_point(trial, self.fixed)
        return overrides + retry_start(study, trial), num, f"trial {trial.number}"

    def _slot_jobs(self, slots: int) -> Any:
        """The worker's slot executor (slot_jobs.py): its trials threads of this process on slots of one group."""
        from hydra_plugins.tinker_exp_plugins.slot_jobs import SlotExecutor

        logging.getLogger().setLevel(logging.INFO)  # as Hydra's job logging sets it for a job (conf/hydra/job_logging)
        return SlotExecutor(self.launcher, slots)

    def checkpoint(self, index: int) -> Any:
        """submitit's hook at the time-limit signal: requeue this worker as it was (its trial resumes, `resumed`)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, index)

    def _keep_pool(self, pools: Any, overrides: list[str]) -> None:
        """This worker's pool, started at its first trial that trains on one; anew when tinker_exp's code changed.

        A trial trains on one with backend.pool auto, one node; a trial with backend.pool=none starts cold, as asked.
        Started anew when tinker_exp's code changed since, so its trials run the code as it is now. The trial takes it
        as `auto` takes a sweep's pool (SWEEP_POOLS_ENV), so its overrides, config and W&B name are those a job of its
        own would have."""
        from hydra_plugins.tinker_exp_plugins.launchers import point_error
        from tinker_exp.place.pools import wanted

        if pools.stale():
            worker_log().info("study worker: the code changed since its pool started; a new pool for the next trials")
            pools.close()
        if not pools.processes:
            cfg, _ = point_error(self.launcher.hydra_context, self.launcher.config, overrides)
            if wanted([cfg]):
                pools.start(1)


def slot_return(job: Any, overrides: list[str], stopping: bool) -> JobReturn | None:
    """What a worker's trial on a slot came to (its JobReturn); None when its worker's stop cut it off.

    The worker stops when its job is requeued at its time limit, or cancelled: the trial is not told, so it stays
    RUNNING under the worker's job id, for the requeued worker to take back (`resumed`) or the sweep to record cut
    off."""
    if job.ret is not None:
        return job.ret
    if stopping:
        return None
    return JobReturn(overrides=overrides, status=JobStatus.FAILED, _return_value=RuntimeError(f"stopped on its slot ({job.state})"))


def at_once(calls: list[Callable[[], Any]]) -> list[Any]:
    """Each call in a thread of its own, all at once; their results, in order (the first error raised, after all end)."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:  # raised in the caller's thread below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,), name=f"at-once-{i}") for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results
