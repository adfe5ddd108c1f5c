"""Entry point: compose (Hydra) -> config -> plan -> (dry run, or) workers -> loop -> sinks.

Config errors and dry runs import no torch, verl or ray: the runtime is imported only past validation (an RL dry run
loads the model's tokenizer and config with transformers, to check its prompts' lengths as the run does).
"""

from __future__ import annotations

import atexit
import copy
import functools
import gc
import logging
from contextlib import contextmanager
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, read_write

from tinker_exp import config
from tinker_exp.config import Config
from tinker_exp.config.compose_errors import one_line_compose_errors, refuse_unknown_flags
from tinker_exp.errors import STOPS, ConfigError, Terminated, TinkerExpError, one_line
from tinker_exp.sweep.jobs import job_info, run_name, sweep_group, write_job_info
from tinker_exp.formats import masked, not_a_folder, read_jsonl
from tinker_exp.train.checkpoints import resume_point
from tinker_exp.train.data import Row, dataset_rows
from tinker_exp.train.early_stop import check_early_stop
from tinker_exp.train.objective import came_to, objective_metric, objective_value, write_objective
from tinker_exp.train.rundir_lock import RunDirLock
from tinker_exp.train.signals import as_stop, sigterm_raises
from tinker_exp.train.start import SAVED_CONFIG, StartPoint, start_point

if TYPE_CHECKING:  # the plan (numpy) is imported once a plan is built: --help, --cfg, compose errors stay at Hydra's cost
    from tinker_exp.assemble import StartWorkers
    from tinker_exp.rl.env import Env
    from tinker_exp.optim import Plan

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
ADAPTER = "adapter"
"""In the run dir, with LoRA: the trained adapter in peft's format, written after the last step."""
log = logging.getLogger(__name__)


def validate(cfg: Config) -> Plan:
    """Everything that can be checked without torch, verl or ray; returns the plan. Raises ConfigError naming the key."""
    from tinker_exp.optim import build_plan
    from tinker_exp.runtime.device import check_cpu_settings  # pure: torch only where a device is probed

    config.check(cfg)
    check_cpu_settings(cfg.backend)
    objective_metric(cfg)
    check_early_stop(cfg)
    return build_plan(cfg.override, cfg.optimizer, cfg.trainer.steps)


def checked_rows(cfg: Config) -> tuple[list[Row], list[Row]]:
    """The training and validation rows, read, split and checked (the chat template too) before any worker starts:
    a dry run and a sweep's check of its points find a data error as the run would."""
    rows = dataset_rows(cfg.data)
    chat = next((row.where for rows_of_a_set in rows for row in rows_of_a_set if row.messages is not None), None)
    config.check_chat_template(cfg.model.path, chat)
    return rows


def checked_env(cfg: Config) -> Env:
    """An RL run's env: its prompt rows read and checked, its reward imported and tried on every row, before any
    worker starts (a dry run finds a bad row or reward as the run would). A dry run also loads the model's
    tokenizer and config (no weights, no worker) to check that each prompt and env.max_new_tokens fit the model, as
    the run checks once it has its sampler."""
    from tinker_exp.rl.env import load_env

    env = load_env(cfg.env)
    if cfg.dry_run:
        from tinker_exp.runtime.inputs import check_env_fits_model

        check_env_fits_model(cfg, env)
    return env


def describe(plan: Plan, steps: list[int], updates_per_batch: int = 1) -> str:
    from tinker_exp.optim.preview import format_table

    table = format_table(plan, steps, updates_per_batch)
    return f"optimizer built with {plan.optimizer_values}; {len(plan)} steps; sent with optimizer_step:\n{table}"


def write_plan(plan: Plan, run_dir: Path, steps: list[int], lineage: dict[str, Any] | None = None) -> Path:
    """plan.json (the schedules, boundaries, the values at some steps and `steps`) into the run dir; returns its path.
    A branch's plan.json also says where it came from (`branch`: the trunk's dir and step; the trunk's plan.json
    holds the plan of the steps before)."""
    import json

    from tinker_exp.optim.preview import PLAN_FILE, write_plan_file

    run_dir.mkdir(parents=True, exist_ok=True)
    write_plan_file(plan, run_dir / PLAN_FILE, steps)
    if lineage:
        doc = json.loads((run_dir / PLAN_FILE).read_text())
        (run_dir / PLAN_FILE).write_text(json.dumps({"branch": lineage, **doc}, indent=1) + "\n")
    return run_dir / PLAN_FILE


def run(
    dcfg: DictConfig,
    run_dir: Path,
    choices: dict[str, Any] | None = None,
    job: dict[str, Any] | None = None,
    start_workers: StartWorkers | None = None,
    hydra_files: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Validate, then train; returns the last metrics row ({} for a dry run). `job`: who runs it (job.json);
    `hydra_files`: Hydra's record of the command (.hydra/). Nothing is written into the run dir before the config,
    its data and its start point are accepted.

    `start_workers`: None for verl's workers on Ray (tests pass a fake for bookkeeping checks)."""
    cfg = config.load(dcfg)
    plan = validate(cfg)
    rows = checked_env(cfg) if cfg.env.active else checked_rows(cfg)  # an env's prompts replace the data set
    resolved = OmegaConf.to_container(dcfg, resolve=True)
    start = start_point(cfg, resolved, run_dir)  # resume or branch: checked against its config, before any worker
    with warm_pool(cfg, start, start_workers) as pool:  # refused (busy) before anything is written
        trains = pool.train_run  # a warm pool runs train_run itself, on its workers
        if trains is None:  # a cold run: its device, model, LoRA targets and tokenized data checked before the record
            from tinker_exp import assemble

            given = None if cfg.dry_run or start.complete else assemble.inputs(cfg, rows, start)
            trains = functools.partial(train_run, given=given)
        else:
            pool.check(cfg, start)  # the same checks, by the pool, before the record
        return accepted_run(cfg, plan, rows, start, run_dir, resolved, choices, job, start_workers, hydra_files, pool, trains)


@contextmanager
def warm_pool(cfg: Config, start: StartPoint, start_workers: StartWorkers | None) -> Iterator[Any]:
    """The warm pool this run trains on (backend.pool), held for it, or a cold start (a dry run, a run that is done,
    one over several nodes and a test's own workers never take a pool)."""
    from tinker_exp.pool.client import Cold, attach

    cold = cfg.dry_run or start.complete or start_workers is not None or cfg.backend.nodes > 1
    pool = Cold() if cold else attach(cfg)
    try:
        yield pool
    finally:
        pool.release()


def accepted_run(
    cfg: Config,
    plan: Plan,
    rows: Any,
    start: StartPoint,
    run_dir: Path,
    resolved: Any,
    choices: dict[str, Any] | None,
    job: dict[str, Any] | None,
    start_workers: StartWorkers | None,
    hydra_files: dict[str, str] | None,
    pool: Any,
    trains: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    """`run` once the command is accepted: its record in the run dir, then the dry run or the training by `trains`
    (train_run, or the warm pool's, on its workers)."""
    write_hydra_files(run_dir, hydra_files or {})  # accepted: from here on the run dir records this command
    write_job_info(run_dir, {**(job or job_info(None, [])), **({"branch": start.lineage} if start.lineage else {})})
    if start.kind != "start":
        log.info(start.describe())
    if start.complete:
        return completed_run(start, run_dir, cfg.trainer.steps)
    if not cfg.dry_run:
        from tinker_exp.assemble import WORKERS_LOG

        log.info(f"worker output: {run_dir / WORKERS_LOG}" + ("" if cfg.verbose else " (verbose=true shows it here too)"))
    log.info(describe(plan, cfg.plan_steps, cfg.rl.updates_per_batch if cfg.env.active else 1))
    plan_file = write_plan(plan, run_dir, cfg.plan_steps, start.lineage)
    if cfg.dry_run:
        from tinker_exp.optim.preview import plot_plan

        plot = plot_plan(plan, run_dir / "plan.png")
        log.info(f"dry run: wrote {plan_file}" + (f" and {plot}" if plot else ""))
        return {}
    from tinker_exp.train.sinks import wandb_run_config

    (run_dir / SAVED_CONFIG).write_text(OmegaConf.to_yaml(resolved))
    wandb_config = wandb_run_config(resolved, plan, choices, job)  # one flat key per value
    if start.trunk_wandb_run_id:
        wandb_config["branch.trunk_wandb_run_id"] = start.trunk_wandb_run_id
    if pool.describe():
        log.info(pool.describe())
    return trains(cfg, plan, rows, start, run_dir, wandb_config, start_workers, (job or {}).get("num"))


def completed_run(start: StartPoint, run_dir: Path, steps: int) -> dict[str, Any]:
    """A rerun of a run that is done: says why and starts nothing; returns its last metrics row."""
    state = start.loop_state
    why = "it was pruned" if state.get("pruned") else "it stopped early" if state.get("early_stopped") else f"trainer.steps={steps}"
    log.info(f"run complete: {run_dir} is done at step {start.step} ({why}; {start.checkpoint.path}); nothing to train")
    logged = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    return logged[-1] if logged else {}


def train_run(
    cfg: Config,
    plan: Plan,
    rows: "tuple[list[Row], list[Row]] | Env",
    start: StartPoint,
    run_dir: Path,
    wandb_config: dict[str, Any],
    start_workers: StartWorkers | None,
    job_number: int | None = None,
    given: Any = None,
) -> dict[str, Any]:
    """Judges, inputs, sinks, workers, the loop (tinker_exp/assemble.py builds each); the workers are freed and the
    sinks closed however the run ends. `job_number`: a sweep job's (its trial, or its member); `given`: the inputs
    when checked already (a cold run's: by `run`, before its record is written).

    Everything that can stop the run (a member's config, device, checkpoint, model, LoRA targets, data) is checked
    before any worker starts; the driver's remaining start-up (the plan's plot, W&B) then runs while the workers build
    their models."""
    from tinker_exp import assemble
    from tinker_exp.sweep.report import REPORT, title_name, write_report
    from tinker_exp.train.loop import train

    judges = assemble.judges(cfg, run_dir, job_number, wandb_config)  # first: a member changes the config
    given = given or assemble.inputs(cfg, rows, start)
    given.tell()
    sinks = assemble.sinks(cfg, run_dir, start.step)
    exit_code, workers = 1, None
    try:
        workers = assemble.workers(cfg, plan, given, run_dir, start_workers)
        assemble.start_wandb(sinks, cfg, plan, run_dir, wandb_config)  # beside the workers' start
        workers.ready()
        assemble.attach(given, workers, sinks)
        checkpointer = assemble.checkpointer(cfg, run_dir, workers, start, given.choice.device)
        last = train(cfg.trainer, plan, workers, given.batches, sinks, checkpointer, start, given.evaluation, judges)
        if cfg.lora.rank:
            adapter = run_dir / ADAPTER
            log.info(f"adapter: {adapter} ({workers.export_adapter(adapter):,} parameters, peft's format)")
        exit_code = 0
    except BaseException as e:
        stop = as_stop(e)
        exit_code = stop.exit_code if isinstance(stop, Terminated) else 1
        if stop is not e:
            raise stop from e
        raise
    finally:
        try:
            given.batches.close()
            if workers is not None:
                workers.shutdown()
        finally:
            sinks.close(exit_code)  # the W&B run is finished (with the exit code) however the job ends
    report = write_report([("", run_dir)], run_dir / REPORT, f"run {title_name(run_dir)}")
    if last:
        rows = read_jsonl(run_dir / "metrics.jsonl")  # a resumed run's earlier steps too: its best evaluation may be there
        log.info(f"done: {last['train/step'] + 1} steps, {came_to(rows or [last])}; {run_dir / 'metrics.jsonl'}; {report}")
    return last


def objective(cfg: Config, run_dir: Path) -> float | None:
    """What the run reports to Hydra's sweeper: trainer.objective over every row of metrics.jsonl (a resumed
    run's earlier rows too), also written to objective.json; None for a dry run."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    from tinker_exp.train.checkpoints import best_checkpoint

    metric, mode = objective_metric(cfg), cfg.trainer.objective_mode.value
    rows = read_jsonl(metrics)
    value = objective_value(rows, metric, mode)
    best = best_checkpoint(run_dir / cfg.checkpoint.dir) if cfg.checkpoint.keep_best else None
    last = resume_point(run_dir / cfg.checkpoint.dir, "auto")
    steps = {"steps": rows[-1]["train/step"] + 1 if rows else 0, "steps_planned": cfg.trainer.steps}
    pruned = {"pruned_at_step": last.step} if last is not None and last.state.get("pruned") else {}
    write_objective(run_dir, metric, mode, value, best, {**steps, **pruned})
    return value


HYDRA_FILES = ".hydra"
"""In the run dir: Hydra's record of the job (config.yaml, hydra.yaml, overrides.yaml). conf/config.yaml sets
hydra.output_subdir to null, so Hydra does not write it before the command is accepted; `run` writes it then."""


def hydra_output_files(task_cfg: DictConfig, hydra_cfg: Any) -> dict[str, str]:
    """What Hydra's run_job would have written into HYDRA_FILES, as Hydra writes it (hydra.yaml names HYDRA_FILES as
    its output_subdir). Taken before the task changes its config (a sweep job's W&B group and name)."""
    from hydra.core.hydra_config import HydraConfig

    whole = copy.deepcopy(HydraConfig.instance().cfg)  # the `hydra` node, as Hydra's run_job saves it
    with read_write(whole.hydra):
        whole.hydra.output_subdir = HYDRA_FILES
    return {
        "config.yaml": OmegaConf.to_yaml(task_cfg),
        "hydra.yaml": masked(OmegaConf.to_yaml(whole)),  # a study's database URL: its password not written
        "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.overrides.task),
    }


def write_hydra_files(run_dir: Path, files: dict[str, str]) -> None:
    if files:
        (run_dir / HYDRA_FILES).mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (run_dir / HYDRA_FILES / name).write_text(text, encoding="utf-8")


def where_a_rerun_starts(dcfg: DictConfig, run_dir: Path) -> str:
    """For Ctrl-C's line: the checkpoint the same command continues from (its resume mode), or step 0."""
    try:
        cfg = config.load(dcfg)
        point = resume_point(run_dir / cfg.checkpoint.dir, cfg.resume.value)
    except TinkerExpError:  # resume=never with checkpoints, none usable, an invalid config: the rerun says why
        return ""
    if point is None:
        return "the same command starts again from step 0: no checkpoint yet"
    return f"the same command continues from {point.path}"


PROCESS_START = time.time()
"""When this process imported the entry, before Hydra made any run dir for its command."""


def made_for_this_command(run_dir: Path) -> bool:
    """Whether Hydra made a sweep job's (empty) run dir for this command: Hydra makes it before the task runs.
    Told by its change time, as Hydra does not say; on a shared file system whose clock runs ahead, an empty dir made
    just before may count as made now (and an empty dir is all that goes). A run's: `RunDirCheck` knows."""
    return run_dir.is_dir() and not any(run_dir.iterdir()) and run_dir.stat().st_ctime >= PROCESS_START


class RunDirCheck(Callback):
    """Hydra's callback (conf/config.yaml: hydra.callbacks), called before Hydra makes a run's dir (or a sweep's):
    a dir that cannot be a folder (a file is there, or above it) is refused in one line, and the topmost folder
    Hydra is about to make for a run is noted, so that a refused command removes what Hydra made, and only that."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        global HYDRA_MADE
        refuse_a_file(str(config.hydra.run.dir), "hydra.run.dir")
        run_dir = Path(str(config.hydra.run.dir)).absolute()
        HYDRA_MADE = next((at for at in reversed([run_dir, *run_dir.parents]) if not at.exists()), None)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        refuse_a_file(str(config.hydra.sweep.dir), "hydra.sweep.dir")


HYDRA_MADE: Path | None = None
"""The topmost folder Hydra makes for this run's dir (the run dir itself, or a parent it lacked), as `RunDirCheck`
found it before Hydra made it; None: the run dir was there."""


def refuse_a_file(path: str, key: str) -> None:
    why = not_a_folder(Path(path))
    if why:  # said and exited here: Hydra turns what a callback raises into a warning and goes on
        error = ConfigError(f"{key}={path}: {why}")
        print(f"tinker_exp: {one_line(error)}", file=sys.stderr)
        sys.exit(error.exit_code)


def remove_what_hydra_made(run_dir: Path, in_sweep: bool, made_now: bool) -> None:
    """A refused command's run dir, made by Hydra for it and left empty, goes; a run's parents Hydra made too
    (outputs/runs/DATE), each only while empty."""
    if not made_now:
        return
    top = run_dir if in_sweep or HYDRA_MADE is None else HYDRA_MADE
    for at in [run_dir, *run_dir.parents]:
        if not at.is_dir() or any(at.iterdir()):
            return
        drop_log_files_in(at)
        at.rmdir()
        if at == top:
            return


def drop_log_files_in(run_dir: Path) -> None:
    """Close and detach the log files Hydra set up in a run dir that goes (never opened: nothing was logged there
    yet), so that a later record in this process does not fail on, or make again, a file in a removed dir."""
    loggers = [logging.getLogger(), *(l for l in logging.Logger.manager.loggerDict.values() if isinstance(l, logging.Logger))]
    for logger in loggers:
        for handler in list(logger.handlers):
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == run_dir.resolve():
                logger.removeHandler(handler)
                handler.close()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(dcfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    hydra_files = hydra_output_files(dcfg, hydra_cfg) if hydra_cfg.output_subdir is None else {}
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    task_overrides = list(hydra_cfg.overrides.task)
    if in_sweep:  # one W&B group per sweep; each job named by its overrides
        dcfg.logger.group = dcfg.logger.group or sweep_group(hydra_cfg.sweep.dir)
        dcfg.logger.run_name = dcfg.logger.run_name or run_name(task_overrides, run_dir.name)
    if dcfg.get("verbose"):  # libraries' log records on the terminal too (the run dir's log has them anyway)
        ours = logging.getLogger("tinker_exp")
        logging.getLogger().handlers += ours.handlers
        ours.handlers = []
    job = job_info(hydra_cfg.job.get("num") if in_sweep else None, task_overrides)
    made_now = made_for_this_command(run_dir) if in_sweep else HYDRA_MADE is not None and run_dir.absolute().is_relative_to(HYDRA_MADE)
    try:
        # From the start: Slurm may stop a job while it is still starting up. The lock before anything is written.
        with sigterm_raises(), RunDirLock(run_dir):
            run(dcfg, run_dir, dict(hydra_cfg.runtime.choices), job, hydra_files=hydra_files)
            return objective(config.load(dcfg), run_dir)  # what any Hydra sweeper optimises (lower is better)
    except STOPS as e:
        print(f"tinker_exp: {one_line(e)}", file=sys.stderr)
        if in_sweep:
            if made_now:  # the sweep was accepted: its fresh job dir keeps who ran the job (job.json), nothing else
                write_job_info(run_dir, job)
            raise  # the sweep's launcher reports it with the job's overrides and run dir
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:
        if in_sweep:
            raise
        raise KeyboardInterrupt(where_a_rerun_starts(dcfg, run_dir)) from e
    finally:
        remove_what_hydra_made(run_dir.absolute(), in_sweep, made_now)  # refused: nothing of it stays


def one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None) -> str:
    """Our own warnings (a broken checkpoint skipped, a leftover schedule parameter) as one line, as our errors
    are; a library's keep Python's form, with its file and line."""
    if Path(filename).resolve().is_relative_to(Path(__file__).resolve().parent):
        return f"tinker_exp: warning: {message}\n"
    return _python_format_warning(message, category, filename, lineno, line)


_python_format_warning = warnings.formatwarning


@functools.cache
def freeze_heap_at_exit() -> None:
    """At the process's exit, leave every object to the OS: the interpreter's last garbage collections walk all
    that torch, verl and Ray built (3.7 s after `import verl...` alone, 11 s at a run's end on a busy 2-core
    machine; 0.2-1.2 s frozen) for memory the OS frees at once. Registered once; runs after the run is over (its
    files closed, its workers freed), so it changes nothing a run writes."""
    atexit.register(gc.freeze)


def main() -> None:
    freeze_heap_at_exit()
    config.register()
    config.cli_help.show_if_asked(sys.argv[1:])
    warnings.formatwarning = one_line_warning
    try:
        with one_line_compose_errors():  # Hydra's compose errors: one line and exit 2, like every config error
            refuse_unknown_flags(sys.argv[1:])
            _hydra_main()
    except KeyboardInterrupt as e:  # Ctrl-C: what was running is stopped (a sweep's jobs cancelled); no traceback
        print("tinker_exp: interrupted (Ctrl-C)" + (f"; {e}" if str(e) else ""), file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
