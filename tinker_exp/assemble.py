"""What a run is put together from: its judges, inputs, batch source, sinks, workers and checkpointer.

Its inputs: device, model, data. Each is built from the config (and the job's environment). `run.train_run` calls these
in order, so neither it nor the loop names a judge, a sink or a batch source.

torch, verl and ray (tinker_exp/runtime/) are imported inside the functions that start them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tinker_exp.config import Config
from tinker_exp.sweep.pbt import Member
from tinker_exp.sweep.study import TrialReport
from tinker_exp.train.checkpoints import Checkpointer, check_checkpoint_device
from tinker_exp.train.data import DataFileBatches, Row, eval_batches
from tinker_exp.train.early_stop import EarlyStop
from tinker_exp.train.evaluation import Evaluation
from tinker_exp.train.judges import Judge
from tinker_exp.train.objective import objective_metric, objective_sign
from tinker_exp.train.protocols import BatchSource, Workers
from tinker_exp.train.sinks import (
    CsvSink, JsonlSink, ProgressBar, Sinks, StartingSink, TensorBoardSink, WandbSink, summary_ops, wandb_environment,
)
from tinker_exp.train.start import StartPoint

if TYPE_CHECKING:
    from tinker_exp.optim import Plan
    from tinker_exp.rl.env import Env

WORKERS_LOG = "workers.log"
"""In the run dir: everything the workers print (verl, torch, Ray), complete."""
METRICS_CSV = "metrics.csv"
"""In the run dir with logger csv: metrics.jsonl's rows as a table."""
TENSORBOARD_DIR = "tensorboard"
"""In the run dir with logger tensorboard: its event files (a sweep dir holds one such folder per trial)."""
log = logging.getLogger(__name__)

JUDGES: list[Callable[[Config, Path, "int | None", dict[str, Any]], "Judge | None"]] = [
    TrialReport.for_run,  # a pruning study's trial: its prune is the stop that counts (early stop is not asked then)
    EarlyStop.for_run,  # trainer.early_stop
    Member.for_run,  # a population's member: decides after the checkpoint of each of its boundaries
]
"""Every kind of judge (train/judges.py), in the order the loop asks them. Each builds itself from (config, run dir,
the sweep job's number, the W&B config), or is None when the run has none of it. A new judge: its own module, and
one line here."""


def judges(cfg: Config, run_dir: Path, job_number: int | None, wandb_config: dict[str, Any]) -> list[Judge]:
    """This run's judges. A judge's bad config stops the run here, before any worker starts."""
    built = (make(cfg, run_dir, job_number, wandb_config) for make in JUDGES)
    return [judge for judge in built if judge is not None]


@dataclass(frozen=True)
class Inputs:
    """What the workers and the loop are given, each checked before any worker starts."""

    choice: Any
    """The resolved device (runtime.device.DeviceChoice)."""
    model_path: Path
    batches: BatchSource
    evaluation: Evaluation | None
    said: tuple[str, ...] = ()
    """What the run says about them (device, LoRA, data), logged by `tell` once they are all accepted: a refused
    command writes no log line into the run dir."""

    def tell(self) -> None:
        for line in self.said:
            log.info(line)


def inputs(cfg: Config, rows: "tuple[list[Row], list[Row]] | Env", start: StartPoint) -> Inputs:
    """Device, the start checkpoint's device, model, LoRA targets and tokenized data: a problem stops the run here.

    An RL run: its env, `rows`."""
    from tinker_exp.runtime.inputs import load_examples

    trainer, data = cfg.trainer, cfg.data
    choice, model_path, said = workers_inputs(cfg, start)
    if cfg.env.active:
        return rl_inputs(cfg, choice, model_path, rows, said)
    train_set, val_set = load_examples(data, model_path, *rows)
    said.append(f"data: training {train_set.describe(data)}" + (f"; validation {val_set.describe(data)}" if rows[1] else ""))
    evaluation = None
    if val_set.examples:
        evaluation = Evaluation(eval_batches(val_set.examples, trainer.batch_size), trainer.eval_every, trainer.steps)
    batches = DataFileBatches(train_set.examples, trainer.batch_size, trainer.seed, data.shuffle)
    return Inputs(choice, model_path, batches, evaluation, tuple(said))


def workers_inputs(cfg: Config, start: StartPoint | None = None) -> tuple[Any, Path, list[str]]:
    """What the workers are built from, each checked before any of them starts; returned with what the run says of them.

    The device (on cuda, the GPUs of a Ray cluster of the run's own), the start checkpoint's device, the model dir and
    (SFT) LoRA's targets in it. A run's `inputs`, and `pool up` before it starts a pool (pool/__main__.py)."""
    from tinker_exp.runtime.device import resolve
    from tinker_exp.runtime.inputs import model_dir

    choice = resolve(cfg.backend)  # before Ray starts: a torch that cannot drive the device asked for stops here
    if choice.device == "cuda":
        from tinker_exp.runtime.device import check_own_cluster, probe

        check_own_cluster(cfg.backend, probe().gpus)
    said = [f"device: {choice.describe()}"]
    if start is not None and start.checkpoint is not None:
        check_checkpoint_device(start.checkpoint, choice.device)
    model_path = model_dir(cfg.model)  # on disk before any worker builds it
    if cfg.lora.rank and not cfg.env.active:
        from tinker_exp.runtime import lora

        said.append(f"LoRA rank {cfg.lora.rank}, alpha {cfg.lora.alpha}: {lora.check(cfg.lora, model_path)}")
    return choice, model_path, said


def rl_inputs(cfg: Config, choice: Any, model_path: Path, env: Env, said: list[str]) -> Inputs:
    """An RL run's batch source and evaluation.

    The env's prompts (in the model's chat template), its reward, the driver's sampler (its weights come from the
    workers once they run: `attach`)."""
    from tinker_exp.rl.prompts import check_prompt_lengths
    from tinker_exp.runtime.sampler import HFSampler
    from tinker_exp.train.rl import OffPolicyBatches, Prompt, RLBatches, RLEvaluation, Weights

    trainer = cfg.trainer
    sampler = HFSampler(model_path, trainer.seed, reference=cfg.rl.uses_reference)
    weights = Weights(sampler)

    def prompts(rows: list) -> list[Prompt]:
        ids = [sampler.prompt_ids(row.prompt) for row in rows]
        check_prompt_lengths(rows, [len(i) for i in ids], cfg.env.max_new_tokens, sampler.positions)
        return [Prompt(row, i) for row, i in zip(rows, ids)]

    if cfg.rl.max_steps_off_policy:
        batches = OffPolicyBatches(prompts(env.train), weights, env.reward, cfg.rl, cfg.env.max_new_tokens, trainer.seed,
                                   total_steps=trainer.steps)  # fmt: skip
    else:
        batches = RLBatches(prompts(env.train), weights, env.reward, cfg.rl, cfg.env.max_new_tokens, trainer.seed)
    evaluation = None
    if env.eval:
        evaluation = RLEvaluation(prompts(env.eval), weights, env.reward, cfg.rl, cfg.env.max_new_tokens,
                                  trainer.eval_every, trainer.steps, trainer.seed + 1)  # fmt: skip
    rl = cfg.rl
    updates = f"{rl.updates_per_batch} optimizer steps a batch" if rl.updates_per_batch > 1 else "one optimizer step a batch"
    kl = f", KL to the initial model {rl.kl_coef} x {rl.kl_estimator}" if rl.kl_coef else ""
    off = f", sampled {rl.max_steps_off_policy} steps off-policy" if rl.max_steps_off_policy else ""
    said.append(f"RL: env {env.name}, {len(env.train)} prompts, {rl.prompts_per_step} x {rl.group_size} samples a batch, "
                f"{updates}, loss {cfg.loss.name.value}{kl}{off}")  # fmt: skip
    return Inputs(choice, model_path, batches, evaluation, tuple(said))


def attach(given: Inputs, running: Workers, into: Sinks) -> None:
    """Once the workers run: an RL source samples from the weights they export; its evaluation's table goes to W&B."""
    if hasattr(given.batches, "attach"):
        given.batches.attach(running)
    if hasattr(given.evaluation, "sink"):
        given.evaluation.sink = into


def sinks(cfg: Config, run_dir: Path, first_step: int, config: dict[str, Any]) -> Sinks:
    """metrics.jsonl, the progress bar, metrics.csv and TensorBoard (each when chosen); W&B joins them later.

    W&B starts once the workers start (`start_wandb`). TensorBoard gets `config`, the flat config W&B gets; it writes
    each row as it comes (flushed, as metrics.jsonl), so a killed run keeps every step it logged there too."""
    if cfg.logger.wandb:  # before the workers start: they inherit it (offline stays offline)
        os.environ.update(wandb_environment(run_dir, cfg.logger.mode.value))
    chosen = [JsonlSink(run_dir / "metrics.jsonl", first_step), ProgressBar(cfg.trainer.steps, first_step)]
    if cfg.logger.csv:
        chosen.append(CsvSink(run_dir / METRICS_CSV, first_step))
    if cfg.logger.tensorboard:
        chosen.append(TensorBoardSink(run_dir / TENSORBOARD_DIR, config, first_step))
    return Sinks(chosen)


def verl_workers(cfg: Config, plan: Plan, model_path: Path, run_dir: Path, choice: Any = None) -> Workers:
    """verl's Tinker workers on a Ray worker group; what they print goes to the run dir's workers.log.

    `choice`: the resolved device (runtime.device.DeviceChoice; None: resolved here)."""
    from tinker_exp.runtime.device import resolve
    from tinker_exp.runtime.worker_output import WorkerOutput
    from tinker_exp.runtime.workers import TinkerWorkers

    arguments = (
        cfg.backend, cfg.optimizer, cfg.trainer, str(model_path), plan.optimizer_values,
        choice or resolve(cfg.backend), WorkerOutput(run_dir / WORKERS_LOG, echo=cfg.verbose), cfg.lora,
    )  # fmt: skip
    if cfg.env.active:
        from tinker_exp.runtime.rl_workers import RLWorkers, rl_loss_fn

        return RLWorkers(*arguments, loss_fn=rl_loss_fn(cfg.loss, cfg.rl), rl=cfg.rl)
    return TinkerWorkers(*arguments)


def start_wandb(into: Sinks, cfg: Config, plan: Plan, run_dir: Path, wandb_config: dict[str, Any]) -> None:
    """The plan's plot and W&B, started beside the workers' start.

    No step waits for them (W&B's rows wait until its run is there), and neither can stop the run (W&B warns and is left
    out)."""
    from tinker_exp.optim.preview import plan_table, plot_plan

    def plot_and_wandb() -> WandbSink | None:
        plot = plot_plan(plan, run_dir / "plan.png")
        if not cfg.logger.wandb:
            return None
        summaries = summary_ops(objective_metric(cfg), cfg.trainer.objective_mode.value, rl=cfg.env.active)
        wandb_sink = WandbSink.start(cfg.logger, run_dir, wandb_config, name=cfg.logger.run_name or run_dir.name, summaries=summaries)
        if wandb_sink is not None:
            wandb_sink.attach_plan(*plan_table(plan, cfg.plan_steps), plot)
        return wandb_sink

    into.sinks.insert(1, StartingSink(plot_and_wandb))


def checkpointer(cfg: Config, run_dir: Path, running: Workers, start: StartPoint, device: str) -> Checkpointer:
    run_state = {"seed": cfg.trainer.seed, "device": device}  # in every checkpoint's loop.json
    if start.lineage:
        run_state["branch"] = start.lineage  # a resumed branch still knows where it came from
    return Checkpointer(run_dir / cfg.checkpoint.dir, cfg.checkpoint, cfg.trainer.steps, running, run_state, objective_metric(cfg),
                        objective_sign(cfg), start.keep_at)  # fmt: skip
