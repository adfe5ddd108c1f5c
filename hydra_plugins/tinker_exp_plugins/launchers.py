"""Our submitit launchers (check every point first, wait for every job, summarize, name failed jobs) and grid sweeper.

The launchers check every point first, wait for every job, summarize the sweep, and fail naming the jobs that failed;
the grid sweeper checks every batch's points before the first one is launched.

hydra-submitit-launcher's own `launch` returns at the first job Slurm killed (abandoning the rest) and
leaves failures to Hydra's sweeper, which names only the first. Ours: refuse a sweep with a bad point before
anything is written or submitted (every bad point named), run at most `max_parallel` local points at once,
wait for all jobs (a killed job is reported by Slurm's accounting, never waited on forever), write
summary.md/summary.jsonl into the sweep dir, then raise one error naming every job that did not complete and
its run dir. Ctrl-C cancels the jobs. A sweeper that keeps some jobs running instead of launching batches (a study)
starts and waits for them one at a time: `SweepLauncher.start`, `wait_any`, `cancel_running`, `capacity`.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from tinker_exp import config as tinker_config
from tinker_exp.config.compose_errors import COMPOSE_ERRORS, as_config_error
from tinker_exp.errors import ConfigError, TinkerExpError, one_line
from tinker_exp.formats import masked
from tinker_exp.place.pools import SweepPools, named, named_pools, slot_pool, wanted
from tinker_exp.sweep import prefixes
from tinker_exp.sweep.jobs import (
    JobOutcome,
    StartedJob,
    bad_points_report,
    failure_report,
    points_at_once,
    read_outcome,
    summary_table,
    write_summary,
)
from tinker_exp.sweep.report import REPORT, display_name, write_report
from tinker_exp.sweep.slot_count import AUTO, varied_keys
from tinker_exp.sweep.slurm import ACTIVE_STATES, Verdicts, cancel_slurm_jobs, slurm_state, slurm_states
from tinker_exp.train.objective import no_objective

log = logging.getLogger(__name__)


class SweepFailedError(TinkerExpError):
    """Some jobs did not complete.

    Ours: the entry point prints the message (every failed job) and nothing else (no traceback, no Hydra hint), exit 1.
    `returns` holds every job's return, for a sweeper that goes on past failed jobs (a study)."""

    def __init__(self, message: str, returns: Sequence[JobReturn] = ()) -> None:
        super().__init__(message)
        self.returns = list(returns)


class BadPointsError(ConfigError):
    """Sweep points that would stop their jobs before any worker starts: every one named, nothing launched."""


class SubmitError(TinkerExpError):
    """sbatch did not take a sweep's jobs (a bad partition, no cluster): sbatch's own message as one line.

    It replaces submitit's traceback. Exit 2 where Slurm refused what the launcher's keys ask for, 1 where sbatch could
    not be run or reach its controller. `submitted`: jobs of this sweep submitted before (none: the sweep leaves nothing
    behind, `nothing_left_unsubmitted`)."""

    def __init__(self, message: str, exit_code: int, submitted: int) -> None:
        super().__init__(message)
        self.exit_code, self.submitted = exit_code, submitted
        self.label = "config error" if exit_code == 2 else "error"


UNREACHED = ("Unable to contact slurm controller", "Socket timed out", "Zero Bytes were transmitted", "temporarily unable",
             "Connection refused", "Could not establish a configuration source")  # fmt: skip
"""sbatch's words where it could not ask the controller (no cluster there, no slurm.conf): not the launcher keys' fault."""


@contextmanager
def sbatch_said(params: dict[str, Any], submitted: int) -> Iterator[None]:
    """Within: sbatch failing is a `SubmitError` naming the launcher key its message is about, where it names one.

    sbatch failing: submitit's FailedJobError, or no sbatch on PATH. What submitit prints of it first is kept off the
    terminal."""
    import io
    from contextlib import redirect_stderr

    from submitit.core.utils import FailedJobError

    try:
        with redirect_stderr(io.StringIO()):  # submitit prints sbatch's stderr, then raises it: said once, below
            yield
    except FailedJobError as e:
        said = "; ".join(dict.fromkeys(line.strip() for line in str(e).splitlines() if line.strip())) or "no message"
        if any(words in said for words in UNREACHED):
            raise SubmitError(f"sbatch could not reach Slurm, no job submitted: {said}", 1, submitted) from None
        key = next((k for k in ("partition", "account", "qos", "constraint", "gres") if k in said.lower() and params.get(k)), None)
        where = f"hydra.launcher.{key}={params[key]}" if key else "hydra.launcher"
        raise SubmitError(f"{where}: sbatch refused the sweep's jobs: {said}", 2, submitted) from None
    except FileNotFoundError as e:
        if "sbatch" not in str(e):
            raise
        raise SubmitError("sbatch: not found on PATH (hydra/launcher=slurm submits with Slurm's sbatch)", 1, submitted) from None


@contextmanager
def nothing_left_unsubmitted(sweep_dir: Path, made_now: bool) -> Iterator[None]:
    """Within: a sweep whose jobs sbatch did not take, none of them submitted, leaves nothing behind.

    Its sweep dir (multirun.yaml, .submitit/, a study's journal) is removed when this command made it."""
    import shutil

    try:
        yield
    except SubmitError as e:
        if made_now and not e.submitted:
            shutil.rmtree(sweep_dir, ignore_errors=True)
        raise


def slot_error(cfg: Any, slots: int) -> str | None:
    """Why a point cannot train on a slot (hydra.launcher.slots > 1), or None."""
    from tinker_exp.config.validate import why_not_on_slot

    if slots <= 1:
        return None
    why = why_not_on_slot(cfg)
    return None if why is None else f"hydra.launcher.slots={slots}: {why}; slots hold LoRA trials (1: one trial a group)"


def point_error(
    hydra_context: Any, config: DictConfig, overrides: Sequence[str], data_checked: set[str] | None = None, slots: int = 1,
    composed: dict[tuple, DictConfig] | None = None,
) -> tuple[Any, str | None]:
    """(the point's typed config, None), or (None, why its job would stop before any worker starts).

    Composed as its job is, then the pure checks `tinker_exp.run.run` makes first (config, plan, data rows, chat
    template). `data_checked`: the data settings already found good in this sweep (a data set is read once, not per
    point). `composed`: a good point's composition (its `hydra` node too) kept there under its overrides, for its job on
    a slot to start from (slot_jobs.py `prepare`: one composition a trial, not two, in the sweep's one thread)."""
    from tinker_exp.run import checked_env, checked_rows, validate  # the run's own checks: no verl or ray

    try:
        whole = hydra_context.config_loader.load_sweep_config(config, list(overrides))
        job_cfg = whole.copy()
        with read_write(job_cfg), open_dict(job_cfg):
            del job_cfg["hydra"]  # what the task function gets (Hydra's run_job)
        cfg = tinker_config.load(job_cfg)
        validate(cfg)
        if why := slot_error(cfg, slots):
            return None, why
        data_key = repr((cfg.env, cfg.model.path) if cfg.env.active else (cfg.data, cfg.model.path))
        if data_checked is None or data_key not in data_checked:
            checked_env(cfg) if cfg.env.active else checked_rows(cfg)  # an env's prompts replace the data set, as in run
            if data_checked is not None:
                data_checked.add(data_key)
    except COMPOSE_ERRORS as e:
        return None, one_line(as_config_error(e))
    except TinkerExpError as e:
        return None, one_line(e)
    if composed is not None:
        composed[tuple(overrides)] = whole
    return cfg, None


def check_points(hydra_context: Any, config: DictConfig, points: Sequence[Sequence[str]], first: int, slots: int = 1) -> list[Any]:
    """Every point's typed config (numbered from `first`); raises BadPointsError naming every bad point.

    `slots`: the launcher's (a point that cannot train on a slot is bad)."""
    data_checked: set[str] = set()
    checked = [point_error(hydra_context, config, overrides, data_checked, slots) for overrides in points]
    bad = {first + i: (filter_overrides(o), error) for i, (o, (_, error)) in enumerate(zip(points, checked)) if error}
    if bad:
        raise BadPointsError(bad_points_report(bad, len(points)))
    return [cfg for cfg, _ in checked]


def continue_line(sweep_dir: Path | str) -> str:
    """Ctrl-C's line in a sweep: the command that continues it, in the sweep dir it used.

    The default sweep dir is timestamped, so the same command alone would start a new sweep. Any password in it
    masked."""
    kept = [a for a in sys.argv[1:] if a.lstrip("+").partition("=")[0] != "hydra.sweep.dir"]
    return masked("continue it with: python -m tinker_exp " + shlex.join([*kept, f"hydra.sweep.dir={sweep_dir}"]))


def save_multirun(config: DictConfig, sweep_dir: Path) -> None:
    """Hydra's record of the sweep's command (multirun.yaml), as every sweeper of ours writes it.

    Any credentials in it (a study's database URL, parseable or mistyped) masked."""
    (sweep_dir / "multirun.yaml").write_text(masked(OmegaConf.to_yaml(config)), encoding="utf-8")


def job_run_dir(hydra_context: Any, config: Any, overrides: Sequence[str], num: int) -> Path:
    """The run dir Hydra gives job `num` with these overrides (hydra.sweep.dir / hydra.sweep.subdir).

    Composed once a job (tinker_exp/sweep/jobs.py RUN_DIRS)."""
    from tinker_exp.sweep.jobs import RUN_DIRS, run_dir_of

    key = (id(config), tuple(overrides), num)
    if key not in RUN_DIRS:
        job_cfg = hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(job_cfg.hydra.job):
            job_cfg.hydra.job.num = num
        RUN_DIRS[key] = (config, run_dir_of(job_cfg))
    return RUN_DIRS[key][1]



POLL_S = 1.0
"""How often `wait_any` looks at its jobs: a job's end is seen within a second, at the cost of a process poll
(local) or one squeue call for all of them (Slurm)."""
RESULT_GRACE_S = 20.0
"""A Slurm job that wrote its result and is still in the queue after this long is taken as ended all the same."""


class SweepLauncher(BaseSubmititLauncher):
    """A launcher of batches of points (a grid sweep) and of single jobs kept running (a study).

    `launch` runs a batch of points and waits for all of them (a grid sweep). A sweeper that keeps a number of jobs
    running instead (a study: the next trial starts as soon as one ends) uses the streaming calls: `start` (one job,
    returns at once), `wait_any` (the jobs that have ended, with what each came to), `cancel_running` (every started job
    not yet returned by `wait_any`), and `capacity` (how many may run at once here)."""

    _CONF: Any = None
    """The launcher's keys (launcher_conf.py): any other key given (`+hydra.launcher.KEY=...`) is refused, not ignored."""

    def __init__(self, **params: Any) -> None:
        if self._CONF is not None:
            import dataclasses

            from tinker_exp.config.compose_errors import no_such_key

            known = [f.name for f in dataclasses.fields(self._CONF) if f.name != "_target_"]
            if unknown := [key for key in params if key not in known]:
                raise ConfigError(no_such_key(f"hydra.launcher.{unknown[0]}", unknown[0], known))
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
        workers = params.get("workers", 0)
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
            raise ConfigError(f"hydra.launcher.workers={workers}: must be an int >= 0 (0: a job per trial)")
        if workers and (params.get("nodes") or 1) > 1:
            raise ConfigError(
                f"hydra.launcher.workers={workers} with hydra.launcher.nodes={params['nodes']}: study workers span one node "
                "each (not yet several); hydra.launcher.workers=0 runs each trial as a job over its nodes"
            )
        max_parallel = params.get("max_parallel")
        if max_parallel is not None and (not isinstance(max_parallel, int) or isinstance(max_parallel, bool) or max_parallel < 1):
            raise ConfigError(f"hydra.launcher.max_parallel={max_parallel}: must be an int >= 1, or null (as many as the CPUs hold)")
        slots = params.get("slots", AUTO)
        if slots != AUTO and (not isinstance(slots, int) or isinstance(slots, bool) or slots < 1):
            raise ConfigError(f"hydra.launcher.slots={slots}: must be an int >= 1 (1: one trial a group) or auto")
        if slots != AUTO and slots > 1 and self._EXECUTOR == "slurm" and not workers:
            raise ConfigError(f"hydra.launcher.slots={slots}: on Slurm, slots hold a study worker's trials; set "
                              "hydra.launcher.workers (0, the default, runs each trial as a job of its own)")
        python = params.get("python")
        if python is not None:
            import shlex
            import shutil

            words = shlex.split(python) if isinstance(python, str) else []
            if not words or shutil.which(words[0]) is None:
                raise ConfigError(f"hydra.launcher.python={python}: not a command found on PATH (null: this interpreter)")
        super().__init__(**params)
        self.outcomes: dict[int, JobOutcome] = {}  # every job this launcher ran, by number: a sweep in batches
        # True: each launch is the whole sweep (the table, and an error at a failed job). A sweeper that launches
        # in batches sets False and ends the sweep itself with `finish` (a grid; a study uses the streaming calls).
        self.summarize = True
        # True: a bad point refuses the whole launch. False (a study): it fails its own trial, without a job.
        self.refuse_bad_points = True
        self.running: list[StartedJob] = []  # started by `start`, not yet returned by `wait_any`
        self.submitted = 0  # jobs sbatch took so far (a refused first submission leaves nothing: `nothing_left_unsubmitted`)
        self.data_checked: set[str] = set()  # the data settings `start` found good (a data set is read once)
        self.stream_executor: Any = None
        self.pools = SweepPools()  # a streaming sweep's (a study's) warm pools: started at its first local job
        self.slot_jobs: Any = None  # with slots: the executor running jobs as threads on slots (slot_jobs.py)
        self.pool_slots: tuple[Path, int] | None = None  # with slots: the warm pool whose slots they take (address, slots)
        self.composed: dict[tuple, DictConfig] = {}  # local: a point `start` checked, composed, for its job on a thread
        # True (a population's sweeper sets it): with slots, each slot keeps its state at its last checkpoint, so
        # that a member's exploit of another member on the group is an in-place copy (runtime/slots.py `SlotGroup`).
        self.keep_saved_states = False
        # hydra.launcher.slots as it applies now: the int asked for, or what `decide_slots` made of auto (None: auto,
        # not decided yet, which checks points as one trial a group does).
        asked = params.get("slots", AUTO)
        self.decided_slots: int | None = None if asked == AUTO else int(asked)

    def slots(self) -> int:
        """LoRA trials a group trains at once (hydra.launcher.slots, local only); 1: one trial a group.

        One trial a group: a thread of this process leasing a pool, or a process starting its own group."""
        return (self.decided_slots or 1) if self._EXECUTOR == "local" else 1

    def decide_slots(self, configs: Sequence[Any], trials: int, swept: Any) -> None:
        """hydra.launcher.slots=auto, decided for a sweep of `trials` trials like `configs`, said in one line.

        `configs`: a grid's points, a study's base point; varying the keys `swept` (tinker_exp/sweep/slot_count.py). An
        int asked for stays as it is. On Slurm only a study worker trains on slots (decided in its job, from its node's
        memory)."""
        if self.params.get("slots", AUTO) != AUTO or (self._EXECUTOR == "slurm" and not self.workers()):
            return
        from tinker_exp.memory import gpu_memory_mb, host_memory_mb
        from tinker_exp.sweep.slot_count import auto_slots

        devices = {cfg.backend.device.value for cfg in configs}
        gpu_mb = None if devices <= {"cpu"} else gpu_memory_mb()  # auto: cuda where nvidia-smi sees a GPU
        device, free_mb = ("cuda", gpu_mb) if gpu_mb is not None or "cuda" in devices else ("cpu", host_memory_mb())
        if self.config is not None and self.config.get("dry_run"):
            k, why = 1, "a dry run plans each point in a process of its own"
        elif not configs:
            k, why = 1, "no point to judge by"
        else:
            k, why = auto_slots(configs, trials, swept, self.params.get("max_parallel"), free_mb, device)
        self.decided_slots = k
        where = f"{k} trials at once on slots of one group" if k > 1 else "one trial a group"
        log.info(f"hydra.launcher.slots=auto: {where} ({why})")

    def decide_study_slots(self, fixed: Sequence[str], trials: int, swept: Any) -> None:
        """`decide_slots` for a study, whose points come one at a time: judged by its base point, once.

        Its base point: its fixed overrides; a swept key is judged by its name (`swept`)."""
        if self.params.get("slots", AUTO) == AUTO and self.decided_slots is None:
            cfg = point_error(self.hydra_context, self.config, fixed, self.data_checked)[0]
            self.decide_slots([cfg] if cfg is not None else [], trials, swept)

    def _executor(self, on_pools: bool = False) -> Any:
        """A submitit executor from the launcher keys (as hydra-submitit-launcher builds it).

        With slots, or `on_pools` (the sweep's pools are up, for its local jobs), the one that runs jobs as threads of
        this process, on one group's slots or each leasing a pool (kept until `end_slots`): no process a job."""
        if self.slots() > 1 or (on_pools and self._EXECUTOR == "local"):
            if self.slot_jobs is None:
                from hydra_plugins.tinker_exp_plugins.slot_jobs import SlotExecutor

                self.slot_jobs = SlotExecutor(self, self.slots())
                self.pool_slots = slot_pool(str(self.config.backend.pool)) if self.slots() > 1 else None
                if self.pool_slots is not None:
                    address, slots = self.pool_slots
                    log.info(f"slots: the trials train on the slots of the warm pool at {address} ({slots} slots; one it "
                             "cannot take trains on a group this process builds)")  # fmt: skip
            return self.slot_jobs
        import submitit

        init_keys, ours = {"max_num_timeout", "python"}, {"max_parallel", "workers", "slots"}
        init = {f"{self._EXECUTOR}_{k}": v for k, v in self.params.items() if k in init_keys}
        try:
            executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=self.params["submitit_folder"], **init)
        except RuntimeError as e:  # submitit's: 'Could not detect "srun", are you indeed on a slurm cluster?'
            if self._EXECUTOR != "slurm" or "srun" not in str(e):
                raise
            chosen = OmegaConf.select(self.config, "hydra.runtime.choices", default={}).get("hydra/launcher", "slurm")
            raise SubmitError(f"hydra/launcher={chosen}: Slurm's commands (srun, sbatch) are not on PATH here; submit "
                              "from a machine of the cluster, or use hydra/launcher=local", 2, self.submitted) from None  # fmt: skip
        common = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{
                k if k in common else f"{self._EXECUTOR}_{k}": v
                for k, v in self.params.items()
                if k not in init_keys | ours | {"submitit_folder"}
            }
        )
        return executor

    def job_points(self, points: Sequence[Sequence[str]]) -> list[list[str]]:
        """The overrides each point's job runs with: a point spanning nodes gets backend.nodes of its allocation."""
        if self.nodes() > 1:
            return [spanning(overrides, self.nodes()) for overrides in points]
        return [list(overrides) for overrides in points]

    def nodes(self) -> int:
        """Nodes per job: more than one makes each sweep point one run over a Ray cluster of its nodes."""
        return int(self.params.get("nodes") or 1) if self._EXECUTOR == "slurm" else 1

    def __call__(self, *args: Any) -> Any:
        """The job, in each of its tasks: one task a node.

        Task 0 runs the Ray head and the tinker_exp run; the others are Ray nodes of it until it ends
        (tinker_exp.runtime.ray_cluster)."""
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
        job_overrides = self.job_points(job_overrides)
        nums = [initial_job_idx + i for i in range(len(job_overrides))]
        if self.params.get("slots", AUTO) == AUTO:
            self.decided_slots = None  # decided again for each batch's points
        if self.refuse_bad_points:  # before anything is written or submitted
            configs = check_points(self.hydra_context, self.config, job_overrides, initial_job_idx, self.slots())
            refused: dict[int, str] = {}
        else:
            data_checked: set[str] = set()
            checked = [point_error(self.hydra_context, self.config, o, data_checked, self.slots()) for o in job_overrides]
            configs = [cfg for cfg, _ in checked]
            refused = {num: error for num, (_, error) in zip(nums, checked) if error}
        if self.decided_slots is None:
            self.decide_slots([cfg for cfg in configs if cfg is not None], len(job_overrides) - len(refused), varied_keys(job_overrides))
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        for num, overrides in zip(nums, job_overrides):
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}" + (f" (not started: {refused[num]})" if num in refused else ""))
        args = [
            (list(o), "hydra.sweep.dir", n, f"job_id_for_{n}", Singleton.get_state())
            for n, o in zip(nums, job_overrides)
            if n not in refused
        ]
        jobs: list[Any] = []  # as they are started (local) or submitted
        verdicts = None
        pools = SweepPools()  # local jobs' warm workers: one pool per job at once, ended after the jobs
        if self._EXECUTOR != "local":
            jobs = self._submit(self._executor(), args)
            verdicts = Verdicts({job.job_id: job.paths.result_pickle.exists for job in jobs}, slurm_states, POLL_S)
        returns, outcomes = [], []
        ended: dict[int, tuple[JobReturn, JobOutcome]] = {}
        try:
            if self._EXECUTOR == "local":
                workers = max((cfg.backend.num_workers for cfg in configs if cfg is not None), default=1)
                at_once = self._at_once(workers, [cfg for cfg in configs if cfg is not None])
                if wanted(configs) and self.slots() == 1:
                    pools.start(min(at_once, len(args)))
                executor = self._executor(on_pools=bool(pools.processes) or named(configs))  # its jobs threads leasing them
                if self.slots() > 1:
                    group = f"the warm pool at {self.pool_slots[0]}" if self.pool_slots else "one group"
                    log.info(f"{len(args)} local jobs, {at_once} at a time on the slots of {group} (hydra.launcher.slots)")
                elif named(configs):
                    log.info(f"{len(args)} local jobs, at most {at_once} at a time (one a pool named in backend.pool: a pool trains one run at a time)")
                else:
                    log.info(f"{len(args)} local jobs, at most {at_once} at a time (hydra.launcher.max_parallel)")
                ended = self._run_local(executor, args, at_once, jobs)
            started = iter(jobs)
            for num, overrides in zip(nums, job_overrides):
                if num in ended:  # a local job: waited for, and said, as it ended
                    ret, outcome = ended[num]
                else:  # a Slurm job (all settled side by side: `verdicts`), or a refused point
                    job = None if num in refused else next(started)
                    ended_by = None if job is None else verdicts.of(job.job_id)
                    ret, outcome = self._outcome(num, overrides, job, refused.get(num), ended_by)
                    log.info(ended_line(outcome))
                returns.append(ret)
                outcomes.append(outcome)
        except KeyboardInterrupt:
            cancel(jobs)  # first, before anything that could be slow on a loaded machine (the pools' end too)
            self.end_slots()  # a job's thread waited for: its run stops on its pool (its line), then the pools end
            pools.close()
            raise KeyboardInterrupt(continue_line(sweep_dir)) from None
        finally:
            pools.close()
            self.end_slots()

        self.outcomes.update((o.num, o) for o in outcomes)
        if self.summarize:
            self.finish(returns)
        else:  # on disk after every batch; the terminal gets the table once, at the sweep's end
            self._write_summary(sweep_dir)
        return returns

    def _run_local(self, executor: Any, args: Sequence[tuple], at_once: int, jobs: list[Any]) -> dict[int, tuple[JobReturn, JobOutcome]]:
        """Run a local job for each of `args` (into `jobs`, in order), at most `at_once` at a time.

        The next starts as soon as one ends. Each job's start and end said as they happen (a long sweep is never
        silent). Returns every job's (JobReturn, JobOutcome) by number."""
        ended: dict[int, tuple[JobReturn, JobOutcome]] = {}
        pending, running = list(args), {}
        while pending or running:
            while pending and len(running) < at_once:
                arg = pending.pop(0)
                with controller_stderr(self.controllers_log()):
                    job = executor.submit(self, *arg)
                jobs.append(job)
                running[job] = arg
                where = getattr(job, "where", f"process {job.job_id}")
                log.info(f"job {arg[2]} started ({where}): {' '.join(filter_overrides(arg[0])) or '-'}")
            done = [job for job in running if job.done()]
            for job in done:
                overrides, _, num = running.pop(job)[:3]
                ended[num] = self._outcome(num, overrides, job, None, wait=True)
                prefixes.mark_ended(Path(str(self.config.hydra.sweep.dir)), num)  # a point waiting for its checkpoint
                log.info(ended_line(ended[num][1]))
            if not done:
                time.sleep(0.2)  # submitit's own wait() polls its processes the same way
        return ended

    def controllers_log(self) -> Path | None:
        """Local jobs: where submitit's job controllers write.

        None on Slurm, where sbatch starts the jobs, and with slots, where no process is started."""
        if self._EXECUTOR != "local" or self.slots() > 1 or self.slot_jobs is not None:
            return None
        return Path(str(self.config.hydra.sweep.dir)) / ".submitit" / CONTROLLERS_LOG

    def _at_once(self, workers: int, configs: Sequence[Any] = ()) -> int:
        """Local jobs at once: the slots, else max_parallel or as many as the CPUs and the jobs' pools hold.

        The slots (no more than max_parallel when set); else max_parallel, or as many as the CPUs hold at one CPU a
        worker, and no more than the pools the jobs name (`configs`: each trains one at a time)."""
        max_parallel = self.params.get("max_parallel")
        if self.slots() > 1:
            return min(self.slots(), max_parallel or self.slots())
        at_once = points_at_once(os.cpu_count(), workers, max_parallel)
        return min(at_once, named_pools(configs) or at_once)

    def capacity(self, config: DictConfig) -> int | None:
        """How many jobs of points like `config` may run at once; None on Slurm, where the scheduler decides.

        Locally: the launcher's slots or `max_parallel` (else as many as the CPUs hold, or the pool they name holds)."""
        if self._EXECUTOR != "local":
            return None
        return self._at_once(config.backend.num_workers, [config])

    def end_slots(self) -> None:
        """With slots: every job's thread stopped and waited for, the group freed (the sweep's end, or its stop)."""
        if self.slot_jobs is not None:
            self.slot_jobs.close()
            self.slot_jobs = None

    def start(self, overrides: Sequence[str], num: int) -> StartedJob:
        """Check the point and start its job as job `num`, returning at once.

        Its run dir and number as `launch` gives them; the job is a local process, or one Slurm job (one sbatch). A
        point the checks refuse raises BadPointsError, or (refuse_bad_points False) comes back as an ended handle
        without a job."""
        assert self.config is not None
        overrides = self.job_points([overrides])[0]
        local = self._EXECUTOR == "local"
        if self.refuse_bad_points:
            [cfg] = check_points(self.hydra_context, self.config, [overrides], num, self.slots())
            refused = None
        else:  # a local job is a thread of this process that starts from this composition (slot_jobs.py `prepare`)
            cfg, refused = point_error(self.hydra_context, self.config, overrides, self.data_checked, self.slots(),
                                       self.composed if local else None)  # fmt: skip
        handle = StartedJob(num, overrides, refused=refused)
        if refused is None:
            Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
            if local and self.slots() == 1 and wanted([cfg]):  # warm workers for this streaming sweep's jobs, till it ends (at exit)
                self.pools.start(self.capacity(self.config) or 1)
            on_pools = bool(self.pools.processes) or named([cfg])
            if self.stream_executor is None or self.slots() > 1 or on_pools:
                self.stream_executor = self._executor(on_pools)
            arg = (list(overrides), "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state())
            # As in `_submit`: a Ctrl-C inside sbatch would leave a job we never learn the id of.
            with sigint_deferred() as interrupted, ray_token(self.nodes() > 1), controller_stderr(self.controllers_log()), self._sbatch():
                handle.job = self.stream_executor.submit(self, *arg)
            self.submitted += 1
            self.composed.pop(tuple(overrides), None)  # a process job composes its own
            self.running.append(handle)
            if interrupted():
                self.cancel_running()
                raise KeyboardInterrupt
        started = f"not started: {refused}" if refused else getattr(handle.job, "where", f"job {handle.job.job_id}")
        log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))} ({started})")
        return handle

    def wait_any(self, handles: Sequence[StartedJob], poll_s: float = POLL_S) -> list[tuple[StartedJob, JobReturn, JobOutcome]]:
        """Wait until at least one of `handles` has ended; each that has, in order, with its JobReturn and JobOutcome.

        Both as `launch` gives them. Looks every `poll_s`: local processes by their exit, Slurm jobs by their result
        file and one squeue call for all of them (a requeued job is waited for again, as in `wait_for`)."""
        if not handles:
            return []
        # Jobs on slots (threads of this process) say when one ends: seen at once, not at the next poll.
        job_ended = getattr(self.slot_jobs, "job_ended", None)
        while True:
            if job_ended is not None:
                job_ended.clear()  # before looking: an end after the look sets it again
            ended = self._ended(handles)
            if ended:
                returns = [(handle, *self._outcome(handle.num, handle.overrides, handle.job, handle.refused, by)) for handle, by in ended]
                self.outcomes.update((outcome.num, outcome) for _, _, outcome in returns)
                self.running = [h for h in self.running if all(h is not handle for handle, _ in ended)]
                return returns
            if job_ended is not None:
                job_ended.wait(poll_s)
            else:
                time.sleep(poll_s)

    def _ended(self, handles: Sequence[StartedJob]) -> list[tuple[StartedJob, str | None]]:
        """(handle, None: it wrote its result or was refused; else the state it ended in) for each ended one.

        A Slurm job that wrote its result counts once Slurm no longer runs it (COMPLETING too), so the next one is
        submitted into a queue that holds no more jobs than the caller keeps running."""
        slurm = [h for h in handles if h.job is not None and self._EXECUTOR == "slurm"]
        states = slurm_states([h.job.job_id for h in slurm])
        ended: list[tuple[StartedJob, str | None]] = []
        for handle in handles:
            job = handle.job
            if job is None:
                ended.append((handle, None))
            elif self._EXECUTOR == "local":  # a process: it wrote its result, or it died (killed, crashed)
                if job.done():
                    ended.append((handle, None if job.paths.result_pickle.exists() else job.state.split()[0]))
            elif job.paths.result_pickle.exists():
                if handle.written_since is None:
                    handle.written_since = time.monotonic()
                # Bounded: a Slurm that does not answer cannot hold a job that has its result.
                if states[job.job_id] not in ACTIVE_STATES or time.monotonic() - handle.written_since >= RESULT_GRACE_S:
                    ended.append((handle, None))
            else:
                verdict = handle.settling.verdict(states[job.job_id])
                if verdict is not None:
                    ended.append((handle, verdict))
        return ended

    def cancel_running(self) -> None:
        """Cancel every job `start` started that `wait_any` has not returned (one scancel for all on Slurm).

        The sweep's pools end with them."""
        jobs, self.running = [h.job for h in self.running], []
        if jobs:
            cancel(jobs)
        self.end_slots()  # before the pools: a job's thread ends once its run on its pool has stopped
        self.pools.close()

    def _outcome(
        self, num: int, overrides: Sequence[str], job: Any, refused: str | None, ended_by: str | None = None, wait: bool = False
    ) -> tuple[JobReturn, JobOutcome]:
        """What job `num` came to.

        `ended_by`: the state the scheduler ended it in (None: it wrote its result); `wait`: wait for it here first.
        `job` None: refused by the checks (a study's)."""
        if wait and job is not None:
            ended_by = wait_for(job)  # None: the job wrote its result
        if job is None:  # a study's trial whose point is bad: failed without a job
            status, error = "FAILED", refused
            ret = JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=error)
        elif ended_by is None:
            ret = job.results()[0]
            status, error = "COMPLETED", None
            if ret.status != JobStatus.COMPLETED:  # raised in the job: a config error, NaN, ...
                status, error = "FAILED", job_error(ret)
        else:  # cancelled, timed out, preempted without requeue, killed, out of memory
            status, error = ended_by, f"ended by the scheduler ({ended_by}); job log {job.paths.stderr}"
            ret = JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=error)
        run_dir = job_run_dir(self.hydra_context, self.config, overrides, num)
        objective = ret.return_value if status == "COMPLETED" else None  # what the task function returned
        job_id = None if job is None else job.job_id
        return ret, read_outcome(num, filter_overrides(overrides), status, run_dir, error, job_id, objective)

    def workers(self) -> int:
        """Study worker jobs to submit (hydra.launcher.workers, Slurm only); 0: a job per trial."""
        return int(self.params.get("workers") or 0) if self._EXECUTOR == "slurm" else 0

    def worker_slots(self) -> int:
        """LoRA trials each study worker trains at once on slots of its group (hydra.launcher.slots).

        1: one after another on its pool."""
        return (self.decided_slots or 1) if self.workers() else 1

    def point_slots(self) -> int:
        """Trials a group trains at once where this sweep's points train: what every point is checked against.

        Where they train: the local launcher's slots, or each study or population worker's. Every point is checked
        against it (`slot_error`); 1: each trains alone."""
        return max(self.slots(), self.worker_slots())

    def check_study_points(self, fixed: Sequence[str], searched: Sequence[str]) -> None:
        """A study none of whose points can take the slots asked for is refused before anything is written.

        It is refused as a grid of them is (`slot_error`): its base point (`fixed`) cannot take a slot, and no searched
        key sets what that depends on (validate.py SLOT_KEYS). A study that searches one of those keys has each point
        checked as it comes (a refused one fails its trial)."""
        from tinker_exp.config.validate import SLOT_KEYS

        slots = self.point_slots()
        keys = [key.lstrip("+~") for key in searched]
        if slots <= 1 or any(key == k or k.startswith(key + ".") or key.startswith(k + ".") for key in keys for k in SLOT_KEYS):
            return
        cfg, _ = point_error(self.hydra_context, self.config, self.job_points([fixed])[0], self.data_checked)
        if cfg is not None and (why := slot_error(cfg, slots)):
            raise ConfigError(why)

    def submit_workers(self, worker: Callable[[int], Any], count: int) -> list[Any]:
        """`count` study worker jobs, one Slurm job array (one sbatch): job i runs `worker(i)`. Returns at once."""
        if self.stream_executor is None:
            self.stream_executor = self._executor()
        with sigint_deferred() as interrupted, self._sbatch():  # as in `_submit`: job ids we would never learn
            jobs = self.stream_executor.map_array(worker, list(range(count)))
        self.submitted += len(jobs)
        if interrupted():
            cancel(jobs)
            raise KeyboardInterrupt
        return jobs

    def _sbatch(self) -> Any:
        """Around a submission: on Slurm, sbatch's failure as one line (`sbatch_said`); locally nothing."""
        from contextlib import nullcontext

        return sbatch_said(self.params, self.submitted) if self._EXECUTOR == "slurm" else nullcontext()

    def _submit(self, executor: Any, args: Sequence[tuple]) -> list[Any]:
        """Every job at once (a Slurm job array): the scheduler decides when each runs."""
        if not args:
            return []
        # A Ctrl-C inside sbatch would leave jobs we never learn the ids of; multi-node jobs need their Ray token.
        with sigint_deferred() as interrupted, ray_token(self.nodes() > 1), self._sbatch():
            jobs = executor.map_array(self, *zip(*args))
        self.submitted += len(jobs)
        if interrupted():
            cancel(jobs)
            raise KeyboardInterrupt(continue_line(str(self.config.hydra.sweep.dir)))
        log.info(f"submitted {', '.join(job.job_id for job in jobs)}; waiting for all of them")
        return jobs

    def _write_summary(self, sweep_dir: Path) -> tuple[Path, Path | None]:
        """summary.md/jsonl and report.png over every job so far (a sweep launched in batches: all of them)."""
        everything = list(self.outcomes.values())
        summary = write_summary(sweep_dir, everything)
        runs = [(f"job {o.num}", Path(o.run_dir)) for o in everything]  # each labelled by what differs
        return summary, write_report(runs, sweep_dir / REPORT, f"sweep {display_name(sweep_dir)}")

    def finish(self, returns: Sequence[JobReturn] = ()) -> None:
        """The end of a sweep: summary files and the table over every job, then one error naming every failed job.

        Every job this launcher ran (all batches); the error counts and names every job that did not complete."""
        assert self.config is not None
        everything = list(self.outcomes.values())
        if not everything:
            return
        summary, report = self._write_summary(Path(str(self.config.hydra.sweep.dir)))
        log.info(f"sweep summary ({', '.join(str(p) for p in (summary, report) if p)}):\n{summary_table(everything)}")
        if not all(outcome.ok for outcome in everything):
            raise SweepFailedError(failure_report(everything, summary), returns)


def ended_line(outcome: JobOutcome) -> str:
    """A grid job's end, said when it ends (as a study says each trial's): what it came to, and its run dir."""
    if outcome.ok:
        value = "" if outcome.objective is None else f", objective {outcome.objective:.6g}"
        return f"job {outcome.num}: completed, {outcome.steps} steps logged{value}; run dir {outcome.run_dir}"
    return f"job {outcome.num} {outcome.status}: {outcome.error}; run dir {outcome.run_dir}"


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
    """Multi-node jobs: a Ray auth token for their clusters in the environment the jobs are submitted with.

    Slurm passes it to every task; never in a file; one for the sweep. The submitting process's own is put back."""
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


def job_objective(ret: JobReturn) -> tuple[float | None, str | None]:
    """(the objective the job returned, None) for a job that completed with a finite one, else (None, why not).

    What a study tells its trial and a population ranks its member by."""
    if ret.status != JobStatus.COMPLETED:
        return None, job_error(ret)
    value = ret.return_value
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return None, no_objective(value)
    return float(value), None


def job_error(ret: JobReturn) -> str:
    """One line: why a job failed (what it raised; a job's own compose error reads as any config error)."""
    raised = ret._return_value
    if isinstance(raised, str):  # set by the launcher: the scheduler ended the job
        return raised
    # Printed and saved (summary.md, optimization_results.yaml): a study's storage URL in it (the job could not
    # reach the study) keeps its password out.
    return masked(one_line(as_config_error(raised) if isinstance(raised, COMPOSE_ERRORS) else raised))


CONTROLLERS_LOG = "controllers.log"
"""In a local sweep's .submitit folder: what submitit's job controllers wrote (a process between the sweep and each
local job; a Ctrl-C or a cancel stops it with a KeyboardInterrupt traceback, which is not the terminal's business)."""


@contextmanager
def controller_stderr(path: Path | None) -> Iterator[None]:
    """Within (`path` given): a process started gets `path` as its stderr, not the sweep's terminal.

    Each local job's own output goes to its log in .submitit/<job id>/ anyway; this is the controller's."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as log_file:
            os.dup2(log_file.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


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
    """Wait until a local job has ended: None when it wrote its result, else its state (killed, crashed).

    A Slurm sweep's jobs are waited for together (`Verdicts`)."""
    job.wait()
    return None if job.paths.result_pickle.exists() else job.state.split()[0]


class OneAtATime:
    """Another launcher (Hydra's basic one: jobs in this process) behind `SweepLauncher`'s streaming calls.

    `start` runs the job to its end, so one runs at a time."""

    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher

    def capacity(self, config: DictConfig) -> int:
        return 1

    def start(self, overrides: Sequence[str], num: int) -> tuple[int, JobReturn]:
        return num, self.launcher.launch([list(overrides)], initial_job_idx=num)[0]

    def wait_any(self, handles: Sequence[tuple[int, JobReturn]]) -> list[tuple[Any, JobReturn, None]]:
        return [(handle, handle[1], None) for handle in handles]

    def cancel_running(self) -> None:
        """Nothing runs between the calls."""

    def end_slots(self) -> None:
        """No slots: jobs run in Hydra's way."""


class SlurmSweepLauncher(SweepLauncher):
    from hydra_plugins.tinker_exp_plugins.launcher_conf import SlurmLauncherConf as _CONF

    _EXECUTOR = "slurm"


class LocalSweepLauncher(SweepLauncher):
    from hydra_plugins.tinker_exp_plugins.launcher_conf import LocalLauncherConf as _CONF

    _EXECUTOR = "local"



class GridSweeper(BasicSweeper):
    """Hydra's basic sweeper (every combination, in batches of `max_batch_size`), plus our checks and summary.

    Plus: every point of every batch checked before anything is written or launched, and with our launchers one failure
    count and one summary table over the whole sweep at its end (each batch runs even when an earlier one had
    failures). On our local launcher, points whose plans share a prefix train it once (`share_prefixes`:
    tinker_exp/sweep/prefixes.py)."""

    def __init__(self, max_batch_size: int | None, params: dict[str, str] | None = None, share_prefixes: bool = True) -> None:
        super().__init__(max_batch_size, params)
        self.share_prefixes = share_prefixes

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.ours = isinstance(self.launcher, SweepLauncher)
        if self.ours:
            self.launcher.summarize = False

    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        self.overrides = self.split_arguments(parser.parse_overrides([*self._parse_config(), *arguments]), self.max_batch_size)
        points = [point for batch in self.overrides for point in batch]
        job_points = self.launcher.job_points(points) if self.ours else points
        configs = check_points(self.hydra_context, self.config, job_points, 0, self.launcher.slots() if self.ours else 1)
        shares = self.plan_prefixes(configs)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        made_now = not sweep_dir.exists()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        save_multirun(self.config, sweep_dir)
        prefixes.clear(sweep_dir)  # an earlier start's decision: decided again, from this command's points
        if any(shares):
            run_dirs = [job_run_dir(self.hydra_context, self.config, o, num) for num, o in enumerate(job_points)]
            prefixes.write(sweep_dir, shares, run_dirs)
        returns, first = [], 0
        with nothing_left_unsubmitted(sweep_dir, made_now):
            while not self.is_done():
                batch = self.get_job_batch()
                results = self.launcher.launch(batch, initial_job_idx=first)
                if not self.ours:  # another launcher: Hydra's way, the first failed job raises
                    for result in results:
                        _ = result.return_value
                first += len(batch)
                returns.append(results)
        if self.ours:
            self.launcher.finish([r for results in returns for r in results])
        return returns

    def plan_prefixes(self, configs: Sequence[Any]) -> list[Any]:
        """Each point's shared prefix (tinker_exp/sweep/prefixes.py), said in one line; all None where none applies.

        Only on our local launcher (a job's wait for another's checkpoint needs both on this machine), and not with
        `share_prefixes` false."""
        from tinker_exp.run import validate
        from tinker_exp.sweep.prefixes import plan_shares, shares_line

        if not (self.share_prefixes and self.ours and self.launcher._EXECUTOR == "local"):
            return [None] * len(configs)
        plans = [validate(cfg) for cfg in configs]  # checked already: the same plans, built again
        shares = plan_shares(configs, plans)
        if any(shares):
            log.info(shares_line(shares, plans))
        return shares
