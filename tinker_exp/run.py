"""A run's steps beneath the entry points (validate, check, place, record, train) and the objective a sweeper reads.

Validate its config, read and check its inputs, hold the place it trains at (tinker_exp/place/), write its record, train
it; the objective a sweeper reads. The CLI (main.py), the pool's process, the sweeps and benchmarks call these; where
the workers come from is the place's business, not the run's.

Config errors and dry runs import no torch, verl or ray: the runtime is imported only past validation (an RL dry run
loads the model's tokenizer and config with transformers, to check its prompts' lengths as the run does).
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from omegaconf import DictConfig, OmegaConf, read_write

from tinker_exp import config
from tinker_exp.config import Config
from tinker_exp.errors import STOPS, Terminated, one_line
from tinker_exp.formats import masked, read_jsonl
from tinker_exp.place import ColdGroup, Place, choose
from tinker_exp.place.lease import Lease
from tinker_exp.sweep.jobs import job_info, run_name, sweep_group, write_job_info
from tinker_exp.train.checkpoints import resume_point
from tinker_exp.train.data import Row, dataset_rows
from tinker_exp.train.early_stop import check_early_stop
from tinker_exp.train.objective import came_to, objective_metric, objective_value, write_objective
from tinker_exp.train.rundir_lock import RunDirLock
from tinker_exp.train.signals import as_stop, sigterm_raises
from tinker_exp.train.start import SAVED_CONFIG, SharedPrefix, StartPoint, start_point

if TYPE_CHECKING:  # the plan (numpy) is imported once a plan is built: --help, --cfg, compose errors stay at Hydra's cost
    from tinker_exp.optim import Plan
    from tinker_exp.rl.env import Env

ADAPTER = "adapter"
"""In the run dir, with LoRA: the trained adapter in peft's format, written after the last step."""
HYDRA_FILES = ".hydra"
"""In the run dir: Hydra's record of the job (config.yaml, hydra.yaml, overrides.yaml). conf/config.yaml sets
hydra.output_subdir to null, so Hydra does not write it before the command is accepted; `run` writes it then."""
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
    """The training and validation rows, read, split and checked (the chat template too) before any worker starts.

    A dry run and a sweep's check of its points find a data error as the run would."""
    rows = dataset_rows(cfg.data)
    chat = next((row.where for rows_of_a_set in rows for row in rows_of_a_set if row.messages is not None), None)
    config.check_chat_template(cfg.model.path, chat)
    return rows


def checked_env(cfg: Config) -> Env:
    """An RL run's env, its prompt rows and its reward checked before any worker starts.

    Its prompt rows are read and checked, its reward imported and tried on every row (a dry run finds a bad row or
    reward as the run would). A dry run also loads the model's tokenizer and config (no weights, no worker) to check
    that each prompt and env.max_new_tokens fit the model, as the run checks once it has its sampler."""
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

    A branch's plan.json also says where it came from (`branch`: the trunk's dir and step; the trunk's plan.json holds
    the plan of the steps before)."""
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
    place: Place | Lease | None = None,
    hydra_files: dict[str, str] | None = None,
    prefix: tuple[SharedPrefix | None, tuple[int, ...]] = (None, ()),
) -> dict[str, Any]:
    """Validate, then train; returns the last metrics row ({} for a dry run).

    `job`: who runs it (job.json); `hydra_files`: Hydra's record of the command (.hydra/). Nothing is written into the
    run dir before the config, its data and its start point are accepted. `prefix`: a grid point's part in a shared
    prefix (tinker_exp/sweep/prefixes.py `role_of`): where its first steps come from, the steps it keeps for others.

    `place`: where it trains (tinker_exp/place/); None: where the config says (backend.pool), found once the run is
    accepted to train (a dry run and a run that is done start no workers)."""
    cfg = config.load(dcfg)
    plan = validate(cfg)
    rows = checked_env(cfg) if cfg.env.active else checked_rows(cfg)  # an env's prompts replace the data set
    resolved = OmegaConf.to_container(dcfg, resolve=True)
    start = start_point(cfg, resolved, run_dir, *prefix)  # resume or branch: checked against its config, before any worker
    idle = cfg.dry_run or start.complete
    held = ColdGroup() if idle else place or choose(cfg)  # a busy pool is refused before anything is written
    try:
        if isinstance(held, Lease):  # the pool trains it, on its workers: it checks the inputs too, and keeps them
            held.check(cfg, rows, start)
            trains = held.train_run
        else:  # in this process: its device, model, LoRA targets and tokenized data checked before the record
            from tinker_exp import assemble

            given = None if idle else assemble.inputs(cfg, rows, start)
            trains = functools.partial(train_run, given=given)
        return accepted_run(cfg, plan, rows, start, run_dir, resolved, choices, job, hydra_files, held, trains)
    finally:
        held.release()


def accepted_run(
    cfg: Config,
    plan: Plan,
    rows: Any,
    start: StartPoint,
    run_dir: Path,
    resolved: Any,
    choices: dict[str, Any] | None,
    job: dict[str, Any] | None,
    hydra_files: dict[str, str] | None,
    place: Place | Lease,
    trains: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    """`run` once the command is accepted: its record in the run dir, then the dry run or the training by `trains`.

    The training: train_run on the place's workers, or the warm pool's train_run, on its own."""
    write_hydra_files(run_dir, hydra_files or {})  # accepted: from here on the run dir records this command
    lineage = {**({"branch": start.lineage} if start.lineage else {}), **({"shared_prefix": start.shared} if start.shared else {})}
    write_job_info(run_dir, {**(job or job_info(None, [])), **lineage})
    if start.kind != "start":
        log.info(start.describe())
    if start.complete:
        return completed_run(start, run_dir, cfg.trainer.steps)
    if not cfg.dry_run:
        from tinker_exp.assemble import WORKERS_LOG

        output = place.workers_log or run_dir / WORKERS_LOG  # a packed group's workers print into its sweep's or pool's
        log.info(f"worker output: {output}" + ("" if cfg.verbose else " (verbose=true shows it here too)"))
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
    if start.shared:
        wandb_config.update({"shared_prefix.from_job": start.shared["job"], "shared_prefix.step": start.shared["step"]})
    if place.describe():
        log.info(place.describe())
    return trains(cfg, plan, rows, start, run_dir, wandb_config, place, (job or {}).get("num"))


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
    place: Place,
    job_number: int | None = None,
    given: Any = None,
) -> dict[str, Any]:
    """Train: judges, inputs, sinks, workers, the loop (tinker_exp/assemble.py builds each).

    The workers are freed and the sinks closed however the run ends. `place`: where its workers come from; `job_number`:
    a sweep job's (its trial, or its member); `given`: the inputs when checked already (a cold run's: by `run`, before
    its record is written).

    Everything that can stop the run (a member's config, device, checkpoint, model, LoRA targets, data) is checked
    before any worker starts; the driver's remaining start-up (the plan's plot, W&B) then runs while the workers build
    their models."""
    from tinker_exp import assemble
    from tinker_exp.sweep.report import REPORT, title_name, write_report
    from tinker_exp.train.loop import train

    judges = assemble.judges(cfg, run_dir, job_number, wandb_config)  # first: a member changes the config
    given = given or assemble.inputs(cfg, rows, start)
    given.tell()
    sinks = assemble.sinks(cfg, run_dir, start.first_logged, wandb_config)
    exit_code, workers = 1, None
    try:
        workers = place.start_workers(cfg, plan, given.model_path, run_dir, given.choice)
        assemble.start_wandb(sinks, cfg, plan, run_dir, wandb_config)  # beside the workers' start
        for row in start.shared_rows:  # a shared prefix's steps, as its source trained them: the run is whole everywhere
            sinks.log(row)
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
    report = write_report([("", run_dir)], run_dir / REPORT, f"run {title_name(run_dir)}", completed=True)
    if last:
        rows = read_jsonl(run_dir / "metrics.jsonl")  # a resumed run's earlier steps too: its best evaluation may be there
        log.info(f"done: {last['train/step'] + 1} steps, {came_to(rows or [last])}; {run_dir / 'metrics.jsonl'}; {report}")
    return last


def objective(cfg: Config, run_dir: Path) -> float | None:
    """What the run reports to Hydra's sweeper: trainer.objective over every row of metrics.jsonl.

    Every row: a resumed run's earlier rows too. Also written to objective.json; None for a dry run."""
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


def write_hydra_files(run_dir: Path, files: dict[str, str]) -> None:
    if files:
        (run_dir / HYDRA_FILES).mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (run_dir / HYDRA_FILES / name).write_text(text, encoding="utf-8")


def hydra_output_files(task_cfg: DictConfig, hydra_cfg: Any, whole: DictConfig | None = None) -> dict[str, str]:
    """What Hydra's run_job would have written into HYDRA_FILES, as Hydra writes it.

    hydra.yaml names HYDRA_FILES as its output_subdir. Taken before the task changes its config (a sweep job's W&B group
    and name). `whole`: the config with its `hydra` node (None: Hydra's, of the job this process runs)."""
    from hydra.core.hydra_config import HydraConfig

    whole = copy.deepcopy(HydraConfig.instance().cfg if whole is None else whole)  # the `hydra` node, as run_job saves it
    with read_write(whole.hydra):
        whole.hydra.output_subdir = HYDRA_FILES
    return {
        "config.yaml": OmegaConf.to_yaml(task_cfg),
        "hydra.yaml": masked(OmegaConf.to_yaml(whole)),  # a study's database URL: its password not written
        "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.overrides.task),
    }


def name_sweep_job(dcfg: DictConfig, sweep_dir: str, task_overrides: list[str], run_dir: Path) -> None:
    """One W&B group per sweep; each job named by its overrides (unless the config names them)."""
    dcfg.logger.group = dcfg.logger.group or sweep_group(sweep_dir)
    dcfg.logger.run_name = dcfg.logger.run_name or run_name(task_overrides, run_dir.name)


def run_and_score(
    dcfg: DictConfig, run_dir: Path, choices: dict[str, Any], job: dict[str, Any], hydra_files: dict[str, str], place: Any = None,
    prefix: tuple[SharedPrefix | None, tuple[int, ...]] = (None, ()),
) -> float | None:
    """The run, holding its run dir, and what any Hydra sweeper optimises (lower is better).

    `place`: where it trains (tinker_exp/place/; None: where its config says); `prefix`: as `run` takes it."""
    # From the start: Slurm may stop a job while it is still starting up. The lock before anything is written.
    with sigterm_raises(), RunDirLock(run_dir):
        run(dcfg, run_dir, choices, job, place=place, hydra_files=hydra_files, prefix=prefix)
        return objective(config.load(dcfg), run_dir)


def sweep_job(
    dcfg: DictConfig, run_dir: Path, choices: dict[str, Any], job: dict[str, Any], hydra_files: dict[str, str], made_now: bool,
    place: Any = None, prefix: tuple[SharedPrefix | None, tuple[int, ...]] = (None, ()),
) -> float | None:
    """A sweep's job (in its own process, or a thread of the sweep's on a slot).

    What stops it is said in one line on its stderr and raised, for the sweep's launcher to report with the job's
    overrides and run dir. `prefix`: its part in the grid's shared prefixes (tinker_exp/sweep/prefixes.py `role_of`)."""
    try:
        return run_and_score(dcfg, run_dir, choices, job, hydra_files, place, prefix)
    except STOPS as e:
        print(f"tinker_exp: {one_line(e)}", file=sys.stderr)
        if made_now:  # the sweep was accepted: its fresh job dir keeps who ran the job (job.json), nothing else
            write_job_info(run_dir, job)
        raise
