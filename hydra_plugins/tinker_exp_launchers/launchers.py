"""Submitit launchers that wait for every job, summarize the sweep, and fail naming the jobs that failed.

hydra-submitit-launcher's own `launch` returns at the first job Slurm killed (abandoning the rest) and
leaves failures to Hydra's sweeper, which names only the first. Ours: wait for all jobs (a killed job is
reported by Slurm's accounting, never waited on forever), write summary.md/summary.jsonl into the sweep
dir, then raise one error naming every job that did not complete and its run dir. Ctrl-C cancels the jobs.
"""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.errors import CompactHydraException
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import OmegaConf, open_dict

from tinker_exp.sweep import failure_report, read_outcome, summary_table, write_summary

log = logging.getLogger(__name__)


class SweepFailedError(CompactHydraException):
    """Some jobs did not complete. Compact: Hydra prints the message (every failed job), no traceback."""


class SweepLauncher(BaseSubmititLauncher):
    def __init__(self, **params: Any) -> None:
        timeout_s, delay_s = params.get("timeout_min", 0) * 60, params.get("signal_delay_s")
        if delay_s is not None and delay_s >= timeout_s:
            # submitit would signal the job before it starts and then refuse to requeue it.
            raise ValueError(
                f"hydra.launcher.signal_delay_s={delay_s} must be below hydra.launcher.timeout_min*60={timeout_s}"
            )
        super().__init__(**params)

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

    def _run_dir(self, overrides: Sequence[str], num: int) -> Path:
        assert self.hydra_context is not None and self.config is not None
        job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(job_cfg.hydra.job):
            job_cfg.hydra.job.num = num
        return Path(str(job_cfg.hydra.sweep.dir)) / str(job_cfg.hydra.sweep.subdir)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        nums = [initial_job_idx + i for i in range(len(job_overrides))]
        for num, overrides in zip(nums, job_overrides):
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
        args = [(list(o), "hydra.sweep.dir", n, f"job_id_for_{n}", Singleton.get_state()) for n, o in zip(nums, job_overrides)]
        jobs = self._executor().map_array(self, *zip(*args))
        log.info(f"submitted {', '.join(job.job_id for job in jobs)}; waiting for all of them")

        returns, outcomes = [], []
        try:
            for num, overrides, job in zip(nums, job_overrides, jobs):
                ended_by = wait_for(job)  # None: the job wrote its result
                if ended_by is None:
                    ret = job.results()[0]
                    status, error = "COMPLETED", None
                    if ret.status != JobStatus.COMPLETED:  # raised in the job: a config error, NaN, ...
                        status, error = "FAILED", describe_error(ret._return_value)
                else:  # cancelled, timed out, preempted without requeue, killed, out of memory
                    status, error = ended_by, f"ended by the scheduler ({ended_by}); job log {job.paths.stderr}"
                    ret = JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=error)
                run_dir = self._run_dir(overrides, num)
                outcomes.append(read_outcome(num, filter_overrides(overrides), status, run_dir, error, job.job_id))
                returns.append(ret)
        except KeyboardInterrupt:
            for job in jobs:
                job.cancel(check=False)
            log.error(f"interrupted: cancelled {', '.join(job.job_id for job in jobs)}")
            raise

        summary = write_summary(sweep_dir, outcomes)
        log.info(f"sweep summary ({summary}):\n{summary_table(outcomes)}")
        if not all(outcome.ok for outcome in outcomes):
            raise SweepFailedError(failure_report(outcomes, summary))
        return returns


# Slurm states of a job that may still write its result. A requeued job passes through REQUEUED,
# PENDING and RUNNING again; PREEMPTED and FAILED can show for a moment on the way (hence the settling).
ACTIVE_STATES = {
    "PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RUNNING", "COMPLETING",
    "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING", "STAGE_OUT", "UNKNOWN",
}  # fmt: skip


def wait_for(job: Any) -> str | None:
    """Wait until the job wrote its result (returns None) or the scheduler ended it (returns its state)."""
    from submitit.slurm.slurm import SlurmJob

    if not isinstance(job, SlurmJob):  # a local process: it writes its result, or it died (killed, crashed)
        job.wait()
        return None if job.paths.result_pickle.exists() else job.state.split()[0]
    return slurm_verdict(job.paths.result_pickle.exists, lambda: slurm_state(job.job_id))


def slurm_verdict(
    result_written: Callable[[], bool],
    state: Callable[[], str],
    poll_s: float = 5.0,
    settle_s: float = 20.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str | None:
    """None once the result is written; else Slurm's end state, taken only once it has held for `settle_s`.

    So a requeued job is waited for again rather than reported from a state it passed through on the way
    (submitit's own wait takes the first final-looking state it sees).
    """
    ended_since = None
    while not result_written():
        now, current = clock(), state()
        if current in ACTIVE_STATES:
            ended_since = None
        elif ended_since is None:
            ended_since = now
        elif now - ended_since >= settle_s:
            return current
        sleep(poll_s)
    return None


def slurm_state(job_id: str) -> str:
    """The job's state in Slurm's accounting: RUNNING, CANCELLED ("CANCELLED by 0" -> CANCELLED), ..."""
    sacct = subprocess.run(
        ["sacct", "--jobs", job_id, "--allocations", "--noheader", "--parsable2", "--format", "State"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    lines = [line for line in sacct.stdout.splitlines() if line.strip()]
    return lines[-1].split()[0] if sacct.returncode == 0 and lines else "UNKNOWN"


def describe_error(error: Any) -> str:
    from tinker_exp.overrides import ConfigError

    if isinstance(error, ConfigError):
        return f"config error: {error}"
    return f"{type(error).__name__}: {error}"


class SlurmSweepLauncher(SweepLauncher):
    _EXECUTOR = "slurm"


class LocalSweepLauncher(SweepLauncher):
    _EXECUTOR = "local"

