"""Entry point: compose (Hydra) -> config -> plan -> (dry run, or) workers -> loop -> sinks.

Config errors and dry runs import no torch, verl or ray: the runtime is imported only past validation.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import hydra
from omegaconf import DictConfig, OmegaConf, read_write

from tinker_exp import config
from tinker_exp.config import Config
from tinker_exp.config.compose_errors import one_line_compose_errors
from tinker_exp.errors import STOPS, Terminated, TinkerExpError, one_line
from tinker_exp.sweep.jobs import job_info, run_name, sweep_group, write_job_info
from tinker_exp.formats import masked, read_jsonl
from tinker_exp.train.checkpoints import check_checkpoint_device, resume_point
from tinker_exp.train.data import Row, dataset_rows
from tinker_exp.train.objective import Watch, check_early_stop, objective_metric, objective_value, write_objective
from tinker_exp.train.protocols import Workers
from tinker_exp.train.rundir_lock import RunDirLock
from tinker_exp.train.signals import as_stop, sigterm_raises
from tinker_exp.train.start import SAVED_CONFIG, StartPoint, start_point

if TYPE_CHECKING:  # the plan (numpy) is imported once a plan is built: --help, --cfg, compose errors stay at Hydra's cost
    from tinker_exp.optim import Plan

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
WORKERS_LOG = "workers.log"
"""In the run dir: everything the workers print (verl, torch, Ray), complete."""
ADAPTER = "adapter"
"""In the run dir, with LoRA: the trained adapter in peft's format, written after the last step."""
log = logging.getLogger(__name__)


def validate(cfg: Config) -> Plan:
    """Everything that can be checked without torch, verl or ray; returns the plan. Raises ConfigError naming the key."""
    from tinker_exp.optim import build_plan

    config.check(cfg)
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


def describe(plan: Plan, steps: list[int]) -> str:
    from tinker_exp.optim.preview import format_table

    return f"optimizer built with {plan.optimizer_values}; {len(plan)} steps; sent with optimizer_step:\n{format_table(plan, steps)}"


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


StartWorkers = Callable[[Config, "Plan", Path, Path], Workers]
"""(config, plan, model dir, run dir) -> the worker group, starting (its `ready()` waits for it)."""


def verl_workers(cfg: Config, plan: Plan, model_path: Path, run_dir: Path, choice: Any = None) -> Workers:
    """verl's Tinker workers on a Ray worker group; what they print goes to the run dir's workers.log.
    `choice`: the resolved device (runtime.device.DeviceChoice; None: resolved here)."""
    from tinker_exp.runtime.device import resolve
    from tinker_exp.runtime.worker_output import WorkerOutput
    from tinker_exp.runtime.workers import TinkerWorkers

    return TinkerWorkers(
        cfg.backend, cfg.optimizer, cfg.trainer, str(model_path), plan.optimizer_values,
        choice or resolve(cfg.backend), WorkerOutput(run_dir / WORKERS_LOG, echo=cfg.verbose), cfg.lora,
    )  # fmt: skip


def run(
    dcfg: DictConfig,
    run_dir: Path,
    choices: dict[str, Any] | None = None,
    job: dict[str, Any] | None = None,
    start_workers: StartWorkers | None = None,
) -> dict[str, Any]:
    """Validate, then train; returns the last metrics row ({} for a dry run). `job`: who runs it (job.json).

    `start_workers`: None for verl's workers on Ray (tests pass a fake for bookkeeping checks)."""
    write_job_info(run_dir, job or job_info(None, []))
    cfg = config.load(dcfg)
    plan = validate(cfg)
    rows = checked_rows(cfg)
    resolved = OmegaConf.to_container(dcfg, resolve=True)
    start = start_point(cfg, resolved, run_dir)  # resume or branch: checked against its config, before any worker
    if start.kind != "start":
        log.info(start.describe())
    if start.lineage:
        write_job_info(run_dir, {**(job or job_info(None, [])), "branch": start.lineage})
    if start.complete:
        state = start.loop_state
        why = "it was pruned" if state.get("pruned") else "it stopped early" if state.get("early_stopped") else f"trainer.steps={cfg.trainer.steps}"
        log.info(f"run complete: {run_dir} is done at step {start.step} ({why}; {start.checkpoint.path}); nothing to train")
        logged = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
        return logged[-1] if logged else {}
    if not cfg.dry_run:
        log.info(f"worker output: {run_dir / WORKERS_LOG}" + ("" if cfg.verbose else " (verbose=true shows it here too)"))
    log.info(describe(plan, cfg.plan_steps))
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
    return train_run(cfg, plan, rows, start, run_dir, wandb_config, start_workers, (job or {}).get("num"))


def train_run(
    cfg: Config,
    plan: Plan,
    rows: tuple[list[Row], list[Row]],
    start: StartPoint,
    run_dir: Path,
    wandb_config: dict[str, Any],
    start_workers: StartWorkers | None,
    trial_number: int | None = None,
) -> dict[str, Any]:
    """Sinks, workers, the loop; `trial_number`: a sweep job's number, its trial when its study prunes. the workers are freed and the sinks closed however the run ends.

    Everything that can stop the run (device, checkpoint, model, LoRA targets, data) is checked before any
    worker starts; the driver's remaining start-up (the plan's plot, W&B) then runs while the workers build
    their models."""
    from tinker_exp.optim.preview import plan_table, plot_plan
    from tinker_exp.runtime.device import resolve
    from tinker_exp.runtime.inputs import load_examples, model_dir
    from tinker_exp.sweep.report import REPORT, title_name, write_report
    from tinker_exp.train.checkpoints import Checkpointer, restore
    from tinker_exp.train.data import batch_for_step, eval_batches
    from tinker_exp.train.evaluation import Evaluation
    from tinker_exp.train.loop import train
    from tinker_exp.train.sinks import JsonlSink, ProgressBar, Sinks, StartingSink, WandbSink, wandb_environment
    from tinker_exp.sweep.pbt import Member
    from tinker_exp.sweep.study import TrialReport

    trainer, data = cfg.trainer, cfg.data
    member = Member.from_environment(cfg, run_dir, trial_number, objective_metric(cfg))  # None unless in a population
    if member is not None:  # every boundary checkpoint stays (other members may load it), and any the user keeps
        cfg.checkpoint.keep_every = math.gcd(cfg.checkpoint.keep_every, member.population.interval)
        wandb_config.update({"population.member": trial_number, "population.board": str(member.population.board)})
    choice = resolve(cfg.backend)  # before Ray starts: a torch that cannot drive the device asked for stops here
    log.info(f"device: {choice.describe()}")
    if start.checkpoint is not None:
        check_checkpoint_device(start.checkpoint, choice.device)
    model_path = model_dir(cfg.model)  # on disk before any worker builds it
    if cfg.lora.rank:
        from tinker_exp.runtime import lora

        log.info(f"LoRA rank {cfg.lora.rank}, alpha {cfg.lora.alpha}: {lora.check(cfg.lora, model_path)}")
    train_set, val_set = load_examples(data, model_path, *rows)  # a data error stops the run here, before any worker
    log.info(f"data: training {train_set.describe(data)}" + (f"; validation {val_set.describe(data)}" if rows[1] else ""))
    examples, val_examples = train_set.examples, val_set.examples
    evaluation = None
    if val_examples:
        evaluation = Evaluation(eval_batches(val_examples, trainer.batch_size), trainer.eval_every, trainer.steps)

    def batch_for(step: int) -> list:
        return batch_for_step(examples, step, trainer.batch_size, trainer.seed, data.shuffle)

    if cfg.logger.name.value == "wandb":  # before the workers start: they inherit it (offline stays offline)
        os.environ.update(wandb_environment(run_dir, cfg.logger.mode.value))
    sinks = Sinks([JsonlSink(run_dir / "metrics.jsonl", start.step), ProgressBar(trainer.steps, start.step)])
    exit_code, workers = 1, None
    try:
        if start_workers is None:
            workers = verl_workers(cfg, plan, model_path, run_dir, choice)
        else:
            workers = start_workers(cfg, plan, model_path, run_dir)

        def plot_and_wandb() -> WandbSink | None:  # neither can stop the run (W&B warns and is left out)
            plot = plot_plan(plan, run_dir / "plan.png")
            if cfg.logger.name.value != "wandb":
                return None
            wandb_sink = WandbSink.start(cfg.logger, run_dir, wandb_config, name=cfg.logger.run_name or run_dir.name)
            if wandb_sink is not None:
                wandb_sink.attach_plan(*plan_table(plan, cfg.plan_steps), plot)
            return wandb_sink

        # Beside the workers' start, and no step waits for it: W&B's rows wait until its run is there.
        sinks.sinks.insert(1, StartingSink(plot_and_wandb))
        workers.ready()
        turn = member.resume(start.step, start.checkpoint.path if start.kind == "resume" else None) if member else None
        loop_start = start.loop_state
        if turn is not None:  # a member's values and plan as it left them (and a donor's state it took there)
            plan = turn.plan
            if turn.nonfinite_steps is not None:
                loop_start["nonfinite_steps"] = turn.nonfinite_steps
        if start.checkpoint is not None:
            restore(workers, (turn and turn.checkpoint) or start.checkpoint.path)
        run_state = {"seed": trainer.seed, "device": choice.device}  # in every checkpoint's loop.json
        if start.lineage:
            run_state["branch"] = start.lineage  # a resumed branch still knows where it came from
        metric, early = objective_metric(cfg), trainer.early_stop
        checkpoint = Checkpointer(run_dir / cfg.checkpoint.dir, cfg.checkpoint, trainer.steps, workers, run_state, metric)
        watch = Watch(metric, early.patience, early.min_delta, start.loop_state.get("watch")) if early.patience else None
        trial = TrialReport.from_environment(metric, trial_number)  # None unless a pruning study launched this job
        last = train(trainer, plan, workers, batch_for, sinks, checkpoint, loop_start, evaluation, watch, trial, member)
        if member is not None:
            log.info(f"population: {len(member.exploits())} exploit(s); the realized schedule: {member.finish()}")
            sinks.attach_table("population/exploits", ["step", "donor", "donor step", "values"], member.exploits())
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
            if workers is not None:
                workers.shutdown()
        finally:
            sinks.close(exit_code)  # the W&B run is finished (with the exit code) however the job ends
    report = write_report([("", run_dir)], run_dir / REPORT, f"run {title_name(run_dir)}")
    if last:
        val = f", val loss {last['val/loss']:.4f}" if "val/loss" in last else ""
        log.info(f"done: {last['train/step'] + 1} steps, final loss {last['train/loss']:.4f}{val}; {run_dir / 'metrics.jsonl'}; {report}")
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
hydra.output_subdir to null, so Hydra does not write it before the run dir is locked; we write it right after."""


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
    try:
        # From the start: Slurm may stop a job while it is still starting up. The lock before anything is written.
        with sigterm_raises(), RunDirLock(run_dir):
            write_hydra_files(run_dir, hydra_files)
            run(dcfg, run_dir, dict(hydra_cfg.runtime.choices), job)
            return objective(config.load(dcfg), run_dir)  # what any Hydra sweeper optimises (lower is better)
    except STOPS as e:
        print(f"tinker_exp: {one_line(e)}", file=sys.stderr)
        if in_sweep:
            raise  # the sweep's launcher reports it with the job's overrides and run dir
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:
        if in_sweep:
            raise
        raise KeyboardInterrupt(where_a_rerun_starts(dcfg, run_dir)) from e


def one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None) -> str:
    """Our own warnings (a broken checkpoint skipped, a leftover schedule parameter) as one line, as our errors
    are; a library's keep Python's form, with its file and line."""
    if Path(filename).resolve().is_relative_to(Path(__file__).resolve().parent):
        return f"tinker_exp: warning: {message}\n"
    return _python_format_warning(message, category, filename, lineno, line)


_python_format_warning = warnings.formatwarning


def main() -> None:
    config.register()
    warnings.formatwarning = one_line_warning
    try:
        with one_line_compose_errors():  # Hydra's compose errors: one line and exit 2, like every config error
            _hydra_main()
    except KeyboardInterrupt as e:  # Ctrl-C: what was running is stopped (a sweep's jobs cancelled); no traceback
        print("tinker_exp: interrupted (Ctrl-C)" + (f"; {e}" if str(e) else ""), file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
