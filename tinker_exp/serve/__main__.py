"""``python -m tinker_exp.serve [serve.host=H] [serve.port=P] [serve.run_dir=DIR] [OVERRIDES]``: the Tinker API on
tinker_exp's workers (docs/serve.md).

The run's config groups compose as for ``python -m tinker_exp`` (model, optimizer, backend, ...; the same overrides);
``serve.*`` are the server's own. Everything is checked before any worker starts; a mistake is one line, exit 2.
The served run dir holds metrics.jsonl (one row per optim_step: the loss, grad norm, requested and applied values),
workers.log, as a run's, and checkpoints/ (save_state, save_weights_for_sampler).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

from tinker_exp.errors import ConfigError, TinkerExpError, one_line


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    """The address the server listens on."""
    port: int = 8000
    """Its port (0: any free one; the line printed at start names it)."""
    run_dir: str = ""
    """Where metrics.jsonl and workers.log go; empty: outputs/serve/<date>/<time>."""
    max_chunk_datums: int = 1024
    """The most datums the SDK sends in one forward_backward request (its `fwdbwd_max_chunk_len`; 1024 is its own
    default): a larger batch comes in chunks, each one pass of the workers, so this bounds a pass's memory."""

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"serve.port: {self.port!r} is not a port (0 .. 65535)")
        if not isinstance(self.max_chunk_datums, int) or self.max_chunk_datums < 1:
            raise ConfigError(f"serve.max_chunk_datums: {self.max_chunk_datums!r} is not a count (an integer >= 1)")


def serve_config(args: list[str]) -> tuple[ServeConfig, list[str]]:
    """The serve.* arguments as a ServeConfig; the rest are the run's overrides."""
    own, rest = {}, []
    for arg in args:
        key, sep, value = arg.partition("=")
        if not key.startswith("serve."):
            rest.append(arg)
            continue
        name = key.removeprefix("serve.")
        keys = ", ".join(f"serve.{name}" for name in ServeConfig.__dataclass_fields__)
        if not sep or name not in ServeConfig.__dataclass_fields__:
            raise ConfigError(f"{key}: not a serve key ({keys}), as serve.KEY=VALUE")
        if ServeConfig.__dataclass_fields__[name].type == "int":
            try:
                value = int(value)
            except ValueError:
                pass  # ServeConfig names the key and the value as typed
        own[name] = value
    return ServeConfig(**own), rest


def main(args: list[str]) -> None:
    import datetime
    import socket

    from hydra import compose, initialize_config_dir

    from tinker_exp import config
    from tinker_exp.main import CONF_DIR

    serve, overrides = serve_config(args)
    config.register()
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from tinker_exp.config.compose_errors import as_config_error

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        try:
            composed = compose(config_name="config", overrides=overrides)
        except (HydraException, OmegaConfBaseException) as e:  # the override grammar's mistakes, as a run's
            raise as_config_error(e) from None
    cfg = config.load(composed)
    config.check(cfg)
    if cfg.env.active:
        raise ConfigError("env: the server takes its data from its client; serve without env=")
    from tinker_exp.optim import build_plan
    from tinker_exp.optim.plan import plan_for

    plan = build_plan(None, cfg.optimizer, 1)  # the optimizer's own values, checked as a run checks them
    run_dir = Path(serve.run_dir or f"outputs/serve/{datetime.datetime.now():%Y-%m-%d/%H-%M-%S-%f}")
    listener = socket.create_server((serve.host, serve.port))  # a port in use: one line, before any worker
    run_dir.mkdir(parents=True, exist_ok=True)

    from tinker_exp.runtime.device import resolve
    from tinker_exp.runtime.inputs import model_dir
    from tinker_exp.runtime.worker_output import WorkerOutput
    from tinker_exp.serve.app import Server, build_app
    from tinker_exp.runtime.serve_workers import ServeWorkers
    from tinker_exp.train.loop import check_applied
    from tinker_exp.train.sinks import JsonlSink, Sinks

    wandb = served_wandb(cfg, composed, serve, run_dir)  # before the workers start: they inherit its environment
    choice = resolve(cfg.backend)
    model_path = model_dir(cfg.model)
    model_name = cfg.model.path or cfg.model.name

    def build_workers(rank: int) -> ServeWorkers:
        lora = replace(cfg.lora, rank=rank)
        workers = ServeWorkers(cfg.backend, cfg.optimizer, cfg.trainer, str(model_path), plan.optimizer_values, choice,
                               WorkerOutput(run_dir / "workers.log"), lora)
        workers.ready()
        return workers

    def optim_params(adam: dict) -> dict:
        return plan_for(adam, plan.optimizer_values, 1, plan.optimizer, float(cfg.optimizer.clip_grad or 0.0))[0]

    def make_sampler():
        from tinker_exp.runtime.serve_sampler import ServedSampler

        return ServedSampler(model_path, cfg.trainer.seed)

    def open_rows(first_step: int) -> Sinks:  # metrics.jsonl reopened where a load_state rewinds it; W&B stays open
        return Sinks([JsonlSink(run_dir / "metrics.jsonl", first_step), wandb and KeptOpen(wandb)])

    server = Server(model_name, build_workers, optim_params, open_rows, check_applied, run_dir / "checkpoints", make_sampler,
                    serve.max_chunk_datums)
    import uvicorn

    host, port = listener.getsockname()[:2]
    print(f"tinker_exp.serve: serving {model_name} on http://{host}:{port} (run dir {run_dir})", flush=True)
    uvicorn.Server(uvicorn.Config(build_app(server), log_level="warning")).run(sockets=[listener])
    if wandb is not None:  # the server stopped (Ctrl-C, SIGTERM): its W&B run ends
        wandb.close()


def served_wandb(cfg, composed, serve: ServeConfig, run_dir: Path):
    """With logger=wandb, the served run's W&B run (started in the background, as a run's; None otherwise): each
    optim_step's row, as in metrics.jsonl, under the config a run would have, plus `serve.*`."""
    if cfg.logger.name.value != "wandb":
        return None
    import os
    from dataclasses import asdict

    from omegaconf import OmegaConf

    from tinker_exp.train.sinks import StartingSink, WandbSink, flat_config, wandb_environment

    os.environ.update(wandb_environment(run_dir, cfg.logger.mode.value))
    config = flat_config({**OmegaConf.to_container(composed, resolve=True), "serve": asdict(serve)})
    return StartingSink(lambda: WandbSink.start(cfg.logger, run_dir, config, name=cfg.logger.run_name or run_dir.name))


class KeptOpen:
    """A sink whose close leaves it open: the server's W&B run outlives a reopened metrics.jsonl."""

    def __init__(self, sink):
        self.sink = sink

    def log(self, row: dict) -> None:
        self.sink.log(row)

    def close(self, exit_code: int = 0) -> None:
        pass


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except TinkerExpError as e:
        print(f"tinker_exp: {one_line(e)}", file=sys.stderr)
        sys.exit(e.exit_code)
    except OSError as e:  # the address: in use, not ours
        print(f"tinker_exp: serve: cannot listen: {e}", file=sys.stderr)
        sys.exit(2)
