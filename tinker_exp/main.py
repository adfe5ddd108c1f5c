"""Entry point: Hydra compose -> validate (pure, instant) -> dry run, or build workers -> loop -> sinks."""

from __future__ import annotations

import signal
import sys
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from tinker_exp.checkpoints import WORKERS, CheckpointError, Checkpointer, resume_point
from tinker_exp.data import resolve_path
from tinker_exp.loop import AppliedMismatchError, NonFiniteError, train
from tinker_exp.overrides import ConfigError
from tinker_exp.plan import Plan, build_plan
from tinker_exp.preview import format_table, plan_table, plot_plan, write_plan_jsonl
from tinker_exp.schema import Config, register_configs
from tinker_exp.sweep import job_info, run_name, sweep_group, write_job_info

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def validate(cfg: Config) -> Plan:
    """Everything that can be checked without torch, verl or ray. Raises ConfigError naming the key."""
    backend, batch = cfg.backend, cfg.trainer.batch_size
    if min(backend.num_workers, backend.nodes, backend.micro_batch_size) < 1:
        raise ConfigError(
            f"backend.num_workers={backend.num_workers}, backend.nodes={backend.nodes} and "
            f"backend.micro_batch_size={backend.micro_batch_size} must be >= 1"
        )
    workers = backend.num_workers * backend.nodes
    over = f"backend.num_workers={backend.num_workers}" + (f" x backend.nodes={backend.nodes}" if backend.nodes > 1 else "")
    if batch % workers or (batch // workers) % backend.micro_batch_size:
        raise ConfigError(
            f"trainer.batch_size={batch} must split evenly over {over} "
            f"into micro batches of backend.micro_batch_size={backend.micro_batch_size}"
        )
    for key in ("every_steps", "keep_last"):
        if getattr(cfg.checkpoint, key) < 0:
            raise ConfigError(f"checkpoint.{key}={getattr(cfg.checkpoint, key)} must be >= 0")
    if cfg.trainer.max_nonfinite_steps < 0:
        raise ConfigError(f"trainer.max_nonfinite_steps={cfg.trainer.max_nonfinite_steps} must be >= 0")
    resolve_path(cfg.data.path)
    return build_plan(cfg.override, cfg.optimizer, cfg.trainer.steps)


def describe(plan: Plan) -> str:
    return f"optimizer built with {plan.optimizer_values}; {len(plan)} steps; sent with optimizer_step:\n{format_table(plan)}"


def write_plan(plan: Plan, run_dir: Path) -> Path | None:
    """plan.jsonl (every step) and plan.png into the run dir; returns the plot's path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_plan_jsonl(plan, run_dir / "plan.jsonl")
    return plot_plan(plan, run_dir / "plan.png")


def run(
    dcfg: DictConfig, run_dir: Path, choices: dict[str, Any] | None = None, job: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Validate, then train; returns the last metrics row ({} for a dry run). `job`: who runs it (job.json)."""
    write_job_info(run_dir, job or job_info(None, []))
    cfg: Config = OmegaConf.to_object(dcfg)
    plan = validate(cfg)
    print(describe(plan), flush=True)
    checkpoint_root = run_dir / cfg.checkpoint.dir
    resume = resume_point(checkpoint_root, cfg.resume.value)
    if resume is not None:
        for why in resume.skipped:
            warnings.warn(f"not resuming from a broken checkpoint: {why}; falling back to {resume.path.name}", stacklevel=1)
        print(f"resuming from {resume.path} at step {resume.step}", flush=True)
    plot = write_plan(plan, run_dir)
    if cfg.dry_run:
        print(f"dry run: wrote {run_dir / 'plan.jsonl'}" + (f" and {plot}" if plot else ""), flush=True)
        return {}

    # Heavy imports only past validation: config errors and dry runs never pay for them.
    from tinker_exp.data import read_rows, tokenize
    from tinker_exp.sinks import JsonlSink, ProgressBar, Sinks, WandbSink
    from tinker_exp.tiny_model import ensure_tiny_model
    from tinker_exp.workers import TinkerWorkers, resolve_device

    resolved = OmegaConf.to_container(dcfg, resolve=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))

    corpus = resolve_path(cfg.data.path)
    model_path = Path(cfg.model.path) if cfg.model.path else ensure_tiny_model(vars(cfg.model), corpus)
    from transformers import AutoTokenizer

    rows = read_rows(corpus, cfg.data.prompt_key, cfg.data.response_key)
    examples = tokenize(rows, AutoTokenizer.from_pretrained(model_path), cfg.data)

    wandb_sink = None
    if cfg.logger.name.value == "wandb":
        wandb_config = {**resolved, "hydra_choices": dict(choices or {}), "job": job}
        wandb_sink = WandbSink.start(cfg.logger, run_dir, wandb_config, name=cfg.logger.run_name or run_dir.name)
        if wandb_sink is not None:
            wandb_sink.attach_plan(*plan_table(plan), plot)
    start = resume.state if resume else {}
    sinks = Sinks([JsonlSink(run_dir / "metrics.jsonl", start.get("step", 0)), wandb_sink, ProgressBar(cfg.trainer.steps)])
    exit_code = 1
    workers = None
    try:
        workers = TinkerWorkers(cfg, str(model_path), plan.optimizer_values, resolve_device(cfg.backend.device.value))
        if resume is not None:
            load_checkpoint(workers, resume.path)
        checkpointer = Checkpointer(checkpoint_root, cfg.checkpoint, cfg.trainer.steps, workers, {"seed": cfg.trainer.seed})
        last = train(cfg, plan, workers, examples, sinks, checkpointer, start)
        exit_code = 0
        return last
    except BaseException as e:
        if isinstance(e, Terminated) or SIGTERM_RECEIVED.is_set():
            exit_code = EXIT_CODES[Terminated][0]
            if not isinstance(e, Terminated):  # raised inside ray.get, Ray hands it back as SystemExit(1)
                raise Terminated(TERMINATED) from e
        raise
    finally:
        try:
            if workers is not None:
                workers.shutdown()
        finally:
            sinks.close(exit_code)  # the W&B run is finished (with the exit code) however the job ends


def load_checkpoint(workers: Any, checkpoint: Path) -> None:
    try:
        workers.load_checkpoint(checkpoint / WORKERS)
    except Exception as e:  # a file that passed the size check but does not load
        raise CheckpointError(f"{checkpoint}: verl could not load it: {type(e).__name__}: {e}") from e


class Terminated(SystemExit):
    """SIGTERM (scancel, preemption, requeue): raised in the loop so the run is closed before Slurm's SIGKILL.

    A SystemExit (code 143), so Hydra's run_job and submitit let it through: a sweep job that Slurm stops
    writes no result, and its launcher reads the job's fate (CANCELLED, or requeued and running again) from
    Slurm instead of a failure.
    """

    def __init__(self, message: str) -> None:
        super().__init__(128 + signal.SIGTERM)
        self.message = message

    def __str__(self) -> str:
        return self.message


TERMINATED = "terminated by SIGTERM (scancel, preemption or the end of the time limit)"
SIGTERM_RECEIVED = threading.Event()


@contextmanager
def sigterm_raises():
    """Within: SIGTERM raises Terminated in the main thread (replacing submitit's handler, which ignores it)."""

    def handler(signum: int, frame: Any) -> None:
        if SIGTERM_RECEIVED.is_set():
            return  # already stopping: a second SIGTERM must not cut the clean-up short
        SIGTERM_RECEIVED.set()
        raise Terminated(TERMINATED)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    SIGTERM_RECEIVED.clear()
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


register_configs()
EXIT_CODES = {
    ConfigError: (2, "config error"),
    AppliedMismatchError: (3, "optimizer override not applied"),
    NonFiniteError: (4, "stopped on non-finite values"),
    CheckpointError: (5, "checkpoint error"),
    Terminated: (128 + signal.SIGTERM, "stopped"),
}


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(dcfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    task_overrides = list(hydra_cfg.overrides.task)
    if in_sweep:  # one W&B group per sweep; each job named by its overrides
        dcfg.logger.group = dcfg.logger.group or sweep_group(hydra_cfg.sweep.dir)
        dcfg.logger.run_name = dcfg.logger.run_name or run_name(task_overrides, run_dir.name)
    job = job_info(hydra_cfg.job.get("num") if in_sweep else None, task_overrides)
    try:
        with sigterm_raises():  # from the start: Slurm may stop a job while it is still starting up
            run(dcfg, run_dir, dict(hydra_cfg.runtime.choices), job)
    except (ConfigError, AppliedMismatchError, NonFiniteError, CheckpointError, Terminated) as e:
        print(f"tinker_exp: {EXIT_CODES[type(e)][1]}: {e}", file=sys.stderr)
        if in_sweep:
            raise  # the sweep's launcher reports it with the job's overrides and run dir
        sys.exit(EXIT_CODES[type(e)][0])


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
