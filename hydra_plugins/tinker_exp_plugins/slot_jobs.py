"""A local sweep's trials as threads of the sweep's own process, not a process each.

On slots (hydra.launcher.slots=K), each job's run on a slot of one LoRA group that process keeps (runtime/warm.py
`SlotGroups`) or of the user's pool; one trial a group (slots 1, its sweep's pools up), each job's run on one of the
sweep's pools, which it leases as a process of its own would (`backend.pool=auto`), its process's start saved.

`SlotExecutor.submit` looks like submitit's to the launcher (a job with `done`, `results`, `cancel`, `wait`,
`state`, `paths`), so the grid's and the study's loops are the same. A job runs what a job's own process runs
(main.py `sweep_job`: its run dir, its record, its run, its objective), with Hydra's per-job globals left alone: its
config composed in the sweep's thread (`prepare`), its log records in its run dir's log (and not on the sweep's
terminal), what it prints (its progress bar, a warning) in its job log `.slots/<num>.log` of the sweep dir.
Cancelled (Ctrl-C, a failed study): its slot's next step raises KeyboardInterrupt, as a Ctrl-C'd run stops.
"""

from __future__ import annotations

import logging
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from tinker_exp import threads

JOB_LOGS = ".slots"
"""In the sweep dir: each slot job's stdout and stderr (`<num>.log`), and what the group's workers print."""


class Written:
    """submitit's `paths.result_pickle`, as the launcher asks it: whether the job returned."""

    def __init__(self, job: "SlotJob") -> None:
        self.job = job

    def exists(self) -> bool:
        return self.job.ret is not None


class Paths:
    """submitit's `paths`, as the launcher asks them: its result, and its log (what the job printed)."""

    def __init__(self, result_pickle: Written, stderr: Path) -> None:
        self.result_pickle, self.stderr = result_pickle, stderr


class SlotJob:
    """One job (a trial, a grid point) as a thread of the sweep's process: submitit's job calls."""

    def __init__(self, num: int, log: Path, where: str) -> None:
        self.num, self.job_id = num, f"slot-job-{num}"
        self.where = where
        self.stop = threading.Event()
        self.ended = threading.Event()
        self.ret: JobReturn | None = None
        self.state = "RUNNING"
        self.paths = Paths(Written(self), log)
        self.thread: threading.Thread | None = None
        self.on_cancel: list[Callable[[], None]] = []
        """Called on `cancel`, besides `stop` set (a trial on a pool's slot: its stop sent to the pool)."""

    def done(self) -> bool:
        return self.ended.is_set()

    def wait(self) -> None:
        self.ended.wait()

    def results(self) -> list[JobReturn]:
        assert self.ret is not None
        return [self.ret]

    def cancel(self, check: bool = False) -> None:
        self.stop.set()
        for call in list(self.on_cancel):
            call()


class SlotExecutor:
    """submitit's executor as the local launcher uses it, for trials as threads.

    `submit(launcher, *args)` starts the job's thread and returns it; `close` waits for every job (bounded), then frees
    the group. `capacity`: the trials a group trains at once on its slots; 1: each trial leases one of the sweep's
    pools, whole (`on_pools`)."""

    def __init__(self, launcher: Any, capacity: int) -> None:
        from tinker_exp.assemble import verl_workers
        from tinker_exp.runtime.warm import SlotGroups

        self.launcher = launcher
        self.sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
        self.logs = self.sweep_dir / JOB_LOGS
        self.router = threads.Router()
        self.on_pools = capacity == 1
        self.groups = None if self.on_pools else SlotGroups(
            capacity, verl_workers, self.logs, self.router.speaking_for, getattr(launcher, "keep_saved_states", False))
        self.jobs: list[SlotJob] = []
        self.job_ended = threading.Event()
        """Set as any job ends (the launcher's `wait_any` waits on it instead of polling)."""
        self.installed: ExitStack | None = None

    def submit(self, launcher: Any, overrides: Sequence[str], dir_key: str, num: int, *rest: Any) -> SlotJob:
        self._install()
        self.logs.mkdir(parents=True, exist_ok=True)
        job = SlotJob(num, self.logs / f"{num}.log", f"a thread of this process, on {'a pool of the sweep' if self.on_pools else 'a slot'}")
        composed = getattr(launcher, "composed", {}).pop(tuple(overrides), None)  # as the launcher checked it
        prepared = prepare(launcher.hydra_context, launcher.config, overrides, num, composed)
        job.thread = threading.Thread(target=self._run, args=(job, prepared), name=f"slot-job-{num}", daemon=True)
        self.jobs.append(job)
        job.thread.start()
        return job

    def _run(self, job: SlotJob, prepared: "Prepared") -> None:
        from tinker_exp.run import sweep_job

        printed = open(job.paths.stderr, "a", encoding="utf-8")
        self.router.add(threads.Route(printed, printed, threads.run_log(prepared.log_file)))
        try:
            import dataclasses

            from tinker_exp.sweep.prefixes import role_of

            shared, keep_at = role_of(self.sweep_dir, job.num)  # a grid point's part in shared prefixes, if any
            shared = shared and dataclasses.replace(shared, stopped=job.stop.is_set)  # cancelled while it waits: it stops
            self._wait_for_source(shared, prepared)
            place = self._place(job, prepared)
            value = sweep_job(prepared.task, prepared.run_dir, prepared.choices, prepared.job, prepared.hydra_files,
                              prepared.made_now, place, (shared, keep_at))  # fmt: skip
            job.ret = JobReturn(overrides=list(prepared.overrides), status=JobStatus.COMPLETED, _return_value=value)
            job.state = "COMPLETED"
        except Exception as e:  # what the job raised, as its process returns it: the launcher says it with its run dir
            job.ret = JobReturn(overrides=list(prepared.overrides), status=JobStatus.FAILED, _return_value=e)
            job.state = "COMPLETED"
        except BaseException:  # stopped (cancelled): no result, as a process killed leaves none
            job.state = "CANCELLED" if job.stop.is_set() else "FAILED"
        finally:
            route = self.router.remove()
            route.records.close()
            route.stdout.close()
            job.ended.set()
            self.job_ended.set()

    def _wait_for_source(self, shared: Any, prepared: "Prepared") -> None:
        """A point whose first steps another trains: wait for that checkpoint before taking a slot or a pool.

        Its run then starts from it at once (tinker_exp/train/start.py `shared_start`); a point with a checkpoint of its
        own resumes from that instead, and waits for nothing."""
        from tinker_exp import config
        from tinker_exp.train.checkpoints import saved_steps
        from tinker_exp.train.start import wait_for_source

        checkpoints = config.load(prepared.task).checkpoint.dir
        if shared is not None and not saved_steps(prepared.run_dir / checkpoints):
            wait_for_source(shared, checkpoints)

    def _place(self, job: SlotJob, prepared: "Prepared") -> Any:
        """Where the trial trains (tinker_exp/place/ `choose`, as its own process would choose).

        It is offered this process's own slot when the sweep is on slots; a pool's lease is told to stop the run when
        the job is cancelled."""
        from tinker_exp import config
        from tinker_exp.assemble import WORKERS_LOG
        from tinker_exp.place import SweepSlot, choose
        from tinker_exp.place.lease import Lease

        own = None if self.groups is None else SweepSlot(self.groups, job.stop, self.logs / WORKERS_LOG)
        place = choose(config.load(prepared.task), own)
        return stopped_with(job, place) if isinstance(place, Lease) else place

    def _install(self) -> None:
        """The router, at the first job: trial threads' prints and records to their own files."""
        if self.installed is None:
            self.installed = ExitStack()
            self.installed.enter_context(self.router.installed())

    def close(self, wait_s: float = 120.0) -> None:
        """Every job stopped at its next step and waited for, then the group freed and the routes taken down.

        Those not ended yet are stopped, and each waited for at most `wait_s`."""
        for job in self.jobs:
            if not job.done():
                job.cancel()
        for job in self.jobs:
            job.ended.wait(wait_s)
        if self.groups is not None:
            self.groups.close()
        if self.installed is not None:
            self.installed.close()
            self.installed = None


def stopped_with(job: SlotJob, lease: Any) -> Any:
    """`lease` (a pool's, place/lease.py `Lease`), told to stop its run when `job` is cancelled (now, if it is)."""
    job.on_cancel.append(lease.ask_stop)
    if job.stop.is_set():
        lease.ask_stop()
    return lease


class Prepared(NamedTuple):
    """A job's config and files, composed in the sweep's thread (Hydra's config loader is not the job thread's)."""

    overrides: list
    task: Any
    run_dir: Path
    choices: dict
    job: dict
    hydra_files: dict
    made_now: bool
    log_file: Path
    """The run dir's log (conf/hydra/job_logging: <run dir>/<hydra.job.name>.log)."""


def prepare(hydra_context: Any, config: DictConfig, overrides: Sequence[str], num: int, composed: DictConfig | None = None) -> Prepared:
    """What Hydra's run_job gives a job's task, without its globals.

    The job's config (its `hydra` node as job `num` of the sweep), its run dir made, its W&B group and name, its
    record's files. `composed`: the job's config as composed already (launchers.py `point_error`), else composed
    here."""
    from tinker_exp.run import hydra_output_files, name_sweep_job
    from tinker_exp.sweep.jobs import RUN_DIRS, job_info, run_dir_of

    whole = composed if composed is not None else hydra_context.config_loader.load_sweep_config(config, list(overrides))
    with open_dict(whole.hydra.job), read_write(whole.hydra):
        whole.hydra.job.num = num
        whole.hydra.job.id = f"slot-job-{num}"
    run_dir = RUN_DIRS.setdefault((id(config), tuple(overrides), num), (config, run_dir_of(whole)))[1]  # once a job
    with read_write(whole.hydra.runtime), open_dict(whole.hydra.runtime):
        whole.hydra.runtime.output_dir = str(run_dir.absolute())
    hydra_node = OmegaConf.create({"hydra": OmegaConf.to_container(whole.hydra, resolve=False)})
    task = whole.copy()
    with read_write(task), open_dict(task):
        del task["hydra"]
    task_overrides = list(whole.hydra.overrides.task)
    hydra_files = hydra_output_files(task, whole.hydra, hydra_node)
    made_now = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    name_sweep_job(task, str(whole.hydra.sweep.dir), task_overrides, run_dir)
    choices = dict(whole.hydra.runtime.choices)
    log_file = run_dir / f"{whole.hydra.job.name}.log"
    return Prepared(list(overrides), task, run_dir, choices, job_info(num, task_overrides), hydra_files, made_now, log_file)
