"""Submitit launchers that wait for every job, summarize the sweep, and fail naming the jobs that failed.

hydra-submitit-launcher's own `launch` returns at the first job Slurm killed (abandoning the rest) and
leaves failures to Hydra's sweeper, which names only the first. Ours: wait for all jobs (a killed job is
reported by Slurm's accounting, never waited on forever), write summary.md/summary.jsonl into the sweep
dir, then raise one error naming every job that did not complete and its run dir. Ctrl-C cancels the jobs.
"""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.errors import CompactHydraException
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import OmegaConf, open_dict

from tinker_exp.config.compose_errors import COMPOSE_ERRORS, as_config_error
from tinker_exp.errors import ConfigError, one_line
from tinker_exp.sweep.jobs import JobOutcome, failure_report, read_outcome, summary_table, write_summary
from tinker_exp.sweep.report import REPORT, display_name, write_report
from tinker_exp.sweep.slurm import cancel_slurm_jobs, slurm_state, slurm_verdict

log = logging.getLogger(__name__)


class SweepFailedError(CompactHydraException):
    """Some jobs did not complete. Compact: Hydra prints the message (every failed job), no traceback.
    `returns` holds every job's return, for a sweeper that goes on past failed jobs (a study)."""

    def __init__(self, message: str, returns: Sequence[JobReturn] = ()) -> None:
        super().__init__(message)
        self.returns = list(returns)


def job_run_dir(hydra_context: Any, config: Any, overrides: Sequence[str], num: int) -> Path:
    """The run dir Hydra gives job `num` with these overrides (hydra.sweep.dir / hydra.sweep.subdir)."""
    job_cfg = hydra_context.config_loader.load_sweep_config(config, list(overrides))
    with open_dict(job_cfg.hydra.job):
        job_cfg.hydra.job.num = num
    return Path(str(job_cfg.hydra.sweep.dir)) / str(job_cfg.hydra.sweep.subdir)


class SweepLauncher(BaseSubmititLauncher):
    def __init__(self, **params: Any) -> None:
        timeout_s, delay_s = params.get("timeout_min", 0) * 60, params.get("signal_delay_s")
        if delay_s is not None and delay_s >= timeout_s:
            # submitit would signal the job before it starts and then refuse to requeue it.
            raise ConfigError(
                f"hydra.launcher.signal_delay_s={delay_s} must be below hydra.launcher.timeout_min*60={timeout_s}"
            )
        if self._EXECUTOR != "slurm" and (params.get("nodes") or 1) > 1:
            raise ConfigError(
                f"hydra.launcher.nodes={params['nodes']}: the local launcher runs each job on this machine; "
                "a point spans nodes with hydra/launcher=slurm"
            )
        super().__init__(**params)
        self.outcomes: dict[int, JobOutcome] = {}  # every job this launcher ran, by number: a sweep in batches
        self.summarize = True  # the table on the terminal after each launch (a study prints its own)


    def _executor(self) -> Any:
        """A submitit executor from the launcher keys (as hydra-submitit-launcher builds it)."""
        import submitit

        init_keys = {"max_num_timeout"}
        init = {f"{self._EXECUTOR}_{k}": v for k, v in self.params.items() if k in init_keys}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=self.params["submitit_folder"], **init)
        common = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{
                k if k in common else f"{self._EXECUTOR}_{k}": v
                for k, v in self.params.items()
                if k not in init_keys | {"submitit_folder"}
            }
        )
        return executor

    def nodes(self) -> int:
        """Nodes per job: more than one makes each sweep point one run over a Ray cluster of its nodes."""
        return int(self.params.get("nodes") or 1) if self._EXECUTOR == "slurm" else 1

    def __call__(self, *args: Any) -> Any:
        """The job, in each of its tasks: one task a node. Task 0 runs the Ray head and the tinker_exp run; the
        others are Ray nodes of it until it ends (tinker_exp.runtime.ray_cluster)."""
        job = super().__call__
        if self.nodes() == 1:
            ret = job(*args)
        else:
            import submitit

            from tinker_exp.runtime.ray_cluster import run_on_allocation

            ret = run_on_allocation(lambda: job(*args), submitit.JobEnvironment().paths.folder)
        if self._EXECUTOR == "slurm" and isinstance(ret, JobReturn) and ret.status == JobStatus.FAILED and slurm_ending_job():
            # The run failed because Slurm is ending the job (requeue, cancel): another node's processes got its
            # SIGTERM first and the workers there died, before it reached this one. No result, as on SIGTERM, so
            # the launcher reads the job's fate from Slurm (a requeued job runs again).
            raise SystemExit(143)
        return ret

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None
        if self.nodes() > 1:  # the run spans the job's nodes: backend.nodes follows the allocation
            job_overrides = [spanning(overrides, self.nodes()) for overrides in job_overrides]
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        nums = [initial_job_idx + i for i in range(len(job_overrides))]
        for num, overrides in zip(nums, job_overrides):
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
        args = [(list(o), "hydra.sweep.dir", n, f"job_id_for_{n}", Singleton.get_state()) for n, o in zip(nums, job_overrides)]
        executor = self._executor()
        # A Ctrl-C inside sbatch would leave jobs we never learn the ids of; multi-node jobs need their Ray token.
        with sigint_deferred() as interrupted, ray_token(self.nodes() > 1):
            jobs = executor.map_array(self, *zip(*args))
        if interrupted():
            cancel(jobs)
            raise KeyboardInterrupt
        log.info(f"submitted {', '.join(job.job_id for job in jobs)}; waiting for all of them")

        returns, outcomes = [], []
        try:
            for num, overrides, job in zip(nums, job_overrides, jobs):
                ended_by = wait_for(job)  # None: the job wrote its result
                if ended_by is None:
                    ret = job.results()[0]
                    status, error = "COMPLETED", None
                    if ret.status != JobStatus.COMPLETED:  # raised in the job: a config error, NaN, ...
                        status, error = "FAILED", job_error(ret)
                else:  # cancelled, timed out, preempted without requeue, killed, out of memory
                    status, error = ended_by, f"ended by the scheduler ({ended_by}); job log {job.paths.stderr}"
                    ret = JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=error)
                run_dir = job_run_dir(self.hydra_context, self.config, overrides, num)
                objective = ret.return_value if status == "COMPLETED" else None  # what the task function returned
                outcomes.append(read_outcome(num, filter_overrides(overrides), status, run_dir, error, job.job_id, objective))
                returns.append(ret)
        except KeyboardInterrupt:
            cancel(jobs)  # first, before anything that could be slow on a loaded machine
            raise

        self.outcomes.update((o.num, o) for o in outcomes)
        everything = list(self.outcomes.values())  # a sweep launched in batches: the summary covers them all
        summary = write_summary(sweep_dir, everything)
        runs = [(f"job {o.num}", Path(o.run_dir)) for o in everything]  # each labelled by what differs
        report = write_report(runs, sweep_dir / REPORT, f"sweep {display_name(sweep_dir)}")
        if self.summarize:
            log.info(f"sweep summary ({', '.join(str(p) for p in (summary, report) if p)}):\n{summary_table(everything)}")
        if not all(outcome.ok for outcome in outcomes):
            raise SweepFailedError(failure_report(outcomes, summary), returns)
        return returns


def slurm_ending_job() -> bool:
    """This job, asked from inside it: Slurm no longer runs it (requeued, cancelled, completing)."""
    import os

    state = slurm_state(os.environ["SLURM_JOB_ID"])
    return state not in ("RUNNING", "UNKNOWN")


def spanning(overrides: Sequence[str], nodes: int) -> list[str]:
    """A point's overrides with backend.nodes set to the job's node count (another value given for it: an error)."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key == "backend.nodes" and value != str(nodes):
            raise ConfigError(
                f"backend.nodes={value}: a sweep point spans hydra.launcher.nodes={nodes} nodes; leave backend.nodes out"
            )
    return [*(o for o in overrides if o.lstrip("+~").partition("=")[0] != "backend.nodes"), f"backend.nodes={nodes}"]


@contextmanager
def ray_token(needed: bool) -> Iterator[None]:
    """Multi-node jobs: a Ray auth token for their clusters in the environment the jobs are submitted with (Slurm
    passes it to every task), never in a file; one for the sweep. The submitting process's own is put back."""
    import os

    if not needed or os.environ.get("RAY_AUTH_TOKEN"):
        yield
        return
    from tinker_exp.runtime.ray_cluster import new_token

    os.environ["RAY_AUTH_TOKEN"] = new_token()
    try:
        yield
    finally:
        os.environ.pop("RAY_AUTH_TOKEN", None)


def job_error(ret: JobReturn) -> str:
    """One line: why a job failed (what it raised; a job's own compose error reads as any config error)."""
    raised = ret._return_value
    if isinstance(raised, str):  # set by the launcher: the scheduler ended the job
        return raised
    return one_line(as_config_error(raised) if isinstance(raised, COMPOSE_ERRORS) else raised)


@contextmanager
def sigint_deferred() -> Iterator[Callable[[], bool]]:
    """Within: Ctrl-C is only noted; the caller asks afterwards whether one came (main thread only)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield lambda: bool(received)
    finally:
        signal.signal(signal.SIGINT, previous)


def cancel(jobs: Sequence[Any]) -> None:
    """Cancel every job of the sweep at once, bounded, with further Ctrl-Cs noted but not obeyed meanwhile."""
    from submitit.slurm.slurm import SlurmJob

    ids = [job.job_id for job in jobs]
    with sigint_deferred():
        if jobs and all(isinstance(job, SlurmJob) for job in jobs):
            done = cancel_slurm_jobs(ids)
        else:  # local processes: submitit signals them
            for job in jobs:
                job.cancel(check=False)
            done = True
    if done:
        log.error(f"interrupted: cancelled {', '.join(ids)}")
    else:
        log.error(f"interrupted: scancel did not answer for {', '.join(ids)}; check squeue and scancel them")


def wait_for(job: Any) -> str | None:
    """Wait until the job wrote its result (returns None) or the scheduler ended it (returns its state)."""
    from submitit.slurm.slurm import SlurmJob

    if not isinstance(job, SlurmJob):  # a local process: it writes its result, or it died (killed, crashed)
        job.wait()
        return None if job.paths.result_pickle.exists() else job.state.split()[0]
    return slurm_verdict(job.paths.result_pickle.exists, lambda: slurm_state(job.job_id))


class SlurmSweepLauncher(SweepLauncher):
    _EXECUTOR = "slurm"


class LocalSweepLauncher(SweepLauncher):
    _EXECUTOR = "local"

