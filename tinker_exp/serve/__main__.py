"""``python -m tinker_exp.serve [OVERRIDES]``: the Tinker API on tinker_exp's workers (docs/serve.md).

``python -m tinker_exp.serve [serve.host=H] [serve.port=P] [serve.run_dir=DIR] [OVERRIDES]``.

The run's config groups compose as for ``python -m tinker_exp`` (model, optimizer, backend, ...; the same overrides);
``serve.*`` are the server's own. Everything is checked before any worker starts; a mistake is one line, exit 2.
The served run dir holds metrics.jsonl (one row per optim_step: the loss, grad norm, requested and applied values),
workers.log, as a run's, and checkpoints/ (save_state, save_weights_for_sampler).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from tinker_exp.errors import ConfigError, TinkerExpError, one_line


API_KEY_ENV = "TINKER_EXP_API_KEY"
"""The environment variable the key is read from when serve.api_key is not given (the safer way: a command line is
visible to every user of the machine in `ps`)."""
KEY_PREFIX, KEY_MIN_CHARS = "tml-", 16
MIN_BODY_BYTES = 4096
RUN_DIR_MARKS = ("job.json", "plan.json", "metrics.jsonl", "summary.jsonl")
"""Files a training run's dir (or a sweep's) holds at its top and a served run dir never does: serve.run_dir there
would write served rows and checkpoints into that run's files."""


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    """The address the server listens on (not loopback: serve.api_key is required)."""
    port: int = 8000
    """Its port (0: any free one; the line printed at start names it)."""
    run_dir: str = ""
    """Where each model's metrics.jsonl, workers.log and checkpoints go; empty: outputs/serve/<date>/<time>."""
    max_chunk_datums: int = 1024
    """The most datums the SDK sends in one forward_backward request (its `fwdbwd_max_chunk_len`; 1024 is its own
    default): a larger batch comes in chunks, each one pass of the workers, so this bounds a pass's memory. A
    request with more is refused (400)."""
    max_num_samples: int = 128
    """The most responses one sample request may ask for (num_samples); more: refused (400)."""
    max_body_bytes: int = 32 << 20
    """The largest request body taken, in bytes; a larger one is refused (400) before it is read. The SDK is told to
    keep its forward_backward chunks under half of it (its fwdbwd_max_chunk_bytes_count, 5 MB at most, its own)."""
    slots: int = 4
    """How many clients' LoRA models of one rank train at once, each on a slot of one worker group (the base model
    loaded once; each model's calls give what they give alone: bitwise, or within 1e-5 when packed with other
    models' calls waiting at once, docs/serve.md); 1: one client at a time. A
    fully fine-tuned model (LoRA rank 0) always trains alone."""
    api_key: str = field(default="", repr=False)
    """The key every request must carry (the SDK's TINKER_API_KEY, sent as X-API-Key); empty: $TINKER_EXP_API_KEY,
    else none (loopback only: any tml- key is taken). Never written anywhere: not in W&B's config, not in a log."""

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"serve.port: {self.port!r} is not a port (0 .. 65535)")
        for name in ("max_chunk_datums", "max_num_samples", "slots"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"serve.{name}: {getattr(self, name)!r} is not a count (an integer >= 1)")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < MIN_BODY_BYTES:
            raise ConfigError(f"serve.max_body_bytes: {self.max_body_bytes!r} is not a size in bytes of at least "
                              f"{MIN_BODY_BYTES} (the SDK's start-up requests must fit)")
        if self.api_key and (not self.api_key.startswith(KEY_PREFIX) or len(self.api_key) < len(KEY_PREFIX) + KEY_MIN_CHARS
                             or not self.api_key.isprintable() or " " in self.api_key):
            # the value is a secret: never in a message
            raise ConfigError(f"serve.api_key: (not shown) is not a key: the SDK sends only keys starting with "
                              f"{KEY_PREFIX}; use {KEY_PREFIX} and at least {KEY_MIN_CHARS} more characters, no spaces "
                              f"(e.g. {KEY_PREFIX}$(python -c 'import secrets; print(secrets.token_hex(16))'))")

    def public(self) -> dict:
        """The settings as W&B's config may hold them: everything but the key."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "api_key"}


def serve_config(args: list[str], environ: dict | None = None) -> tuple[ServeConfig, list[str]]:
    """The serve.* arguments as a ServeConfig; the rest are the run's overrides.

    serve.api_key, else $TINKER_EXP_API_KEY."""
    import os

    environ = os.environ if environ is None else environ
    own, rest = {}, []
    keys = ", ".join(f"serve.{name}" for name in ServeConfig.__dataclass_fields__)
    for arg in args:
        key, sep, value = arg.partition("=")
        bare = key.lstrip("+")
        if not bare.startswith("serve.") and "api_key" not in bare.lower():
            rest.append(arg)
            continue
        name = bare.removeprefix("serve.")
        if not sep or not bare.startswith("serve.") or name not in ServeConfig.__dataclass_fields__:
            # never the value: it may be a mistyped key
            raise ConfigError(f"{key}: not a serve key ({keys}), as serve.KEY=VALUE")
        if ServeConfig.__dataclass_fields__[name].type == "int":
            try:
                value = int(value)
            except ValueError:
                pass  # ServeConfig names the key and the value as typed
        own[name] = value
    if not own.get("api_key") and environ.get(API_KEY_ENV):
        try:
            return ServeConfig(**{**own, "api_key": environ[API_KEY_ENV]}), rest
        except ConfigError as e:
            raise ConfigError(str(e).replace("serve.api_key:", f"{API_KEY_ENV}:", 1)) from None
    return ServeConfig(**own), rest


def loopback(host: str) -> bool:
    """Whether `host` is a loopback address (or a name that resolves only to loopback ones)."""
    import ipaddress
    import socket

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False  # not resolvable: create_server names it below
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_access(serve: ServeConfig) -> None:
    """A server that listens beyond this machine takes only requests that carry its key."""
    if not serve.api_key and not loopback(serve.host):
        raise ConfigError(f"serve.host: {serve.host!r} is not a loopback address: anyone who reaches the port could "
                          f"train, overwrite checkpoints and sample the weights; set a key ({API_KEY_ENV}=tml-..., or "
                          "serve.api_key) or serve on 127.0.0.1")


def check_run_dir(run_dir: Path) -> None:
    """serve.run_dir must be a folder (or become one: no file on its way) and not a training run's (or a sweep's) dir.

    Served rows would land in its files."""
    for folder in (run_dir, *run_dir.parents):
        if folder.exists() or folder.is_symlink():
            if not folder.is_dir():
                where = "" if folder == run_dir else f": {str(folder)!r}"
                raise ConfigError(f"serve.run_dir: {str(run_dir)!r}{where} is a file, not a folder; give a folder "
                                  "(it is made if it does not exist)")
            break
    marks = [name for name in RUN_DIR_MARKS if (run_dir / name).exists()]
    if marks:
        raise ConfigError(f"serve.run_dir: {str(run_dir)!r} is a training run's dir (it holds {marks[0]}): the served "
                          "models' rows and checkpoints would land among that run's files; give a dir of its own")


def listen(serve: ServeConfig):
    """The listening socket (before any worker starts); an address that cannot be bound names its key."""
    import errno
    import os
    import socket

    try:
        return socket.create_server((serve.host, serve.port))
    except socket.gaierror as e:
        raise ConfigError(f"serve.host: {serve.host!r} is not an address of this machine ({e.strerror})") from None
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EACCES) and serve.port:
            raise ConfigError(f"serve.port: {serve.port} cannot be listened on ({os.strerror(e.errno)}; serve.port=0 "
                              "takes a free one)") from None
        why = os.strerror(e.errno) if e.errno else str(e)
        raise ConfigError(f"serve.host: {serve.host!r} cannot be listened on ({why})") from None


def main(args: list[str]) -> None:
    import datetime

    from tinker_exp import config

    serve, overrides = serve_config(args)
    scrub_key(serve)  # from here the key is in `serve` alone: not in sys.argv, nor in the workers' environment
    check_access(serve)
    run_dir = Path(serve.run_dir or f"outputs/serve/{datetime.datetime.now():%Y-%m-%d/%H-%M-%S-%f}")
    check_run_dir(run_dir)
    listener = listen(serve)  # a port in use, a host not ours: one line, before any worker
    composed = config.compose_dict(overrides)
    cfg = config.load(composed)
    config.check(cfg)
    if cfg.env.active:
        raise ConfigError("env: the server takes its data from its client; serve without env=")
    from tinker_exp.optim.optimizers import spec_of

    if spec_of(cfg.optimizer.name.value).averaged:  # its forward, sampling and saved weights would be the training point
        raise ConfigError(f"optimizer.name: {cfg.optimizer.name.value} is not served yet (its averaged weights are not what the server samples); choose another optimizer")
    from tinker_exp.optim import build_plan
    from tinker_exp.optim.plan import plan_for

    plan = build_plan(None, cfg.optimizer, 1)  # the optimizer's own values, checked as a run checks them
    run_dir.mkdir(parents=True, exist_ok=True)

    from tinker_exp.runtime.device import resolve
    from tinker_exp.runtime.inputs import model_dir
    from tinker_exp.runtime.warm import MAX_GROUPS, Kept, KeptGroups, cluster_capacity, group_key, resident_mb
    from tinker_exp.runtime.worker_output import WorkerOutput
    from tinker_exp.serve.app import Server, build_app
    from tinker_exp.runtime.serve_workers import ServedSlot, ServedSlots, ServeWorkers, model_positions, vocabulary_size
    from tinker_exp.train.loop import check_applied
    from tinker_exp.train.sinks import JsonlSink, Sinks

    wandb = served_wandb(cfg, composed, serve, run_dir)  # before the workers start: they inherit its environment
    choice = resolve(cfg.backend)
    model_path = model_dir(cfg.model)
    model_name = cfg.model.path or cfg.model.name

    def say(line: str) -> None:
        print(f"tinker_exp.serve: {line}", file=sys.stderr, flush=True)

    # The groups of clients' models whose sessions ended, kept warm by key for the next clients' (docs/pool.md).
    kept = KeptGroups(MAX_GROUPS, None, say=say)
    on_slots: dict[str, Kept] = {}
    """The LoRA groups holding models now, by key: each a ServedSlots (runtime/serve_workers.py), kept warm once it
    holds none."""

    def new_group(key: dict, model_cfg) -> Kept:
        """A new group for `key`, the least recently used kept ones freed first if it would not fit."""
        workers_each = cfg.backend.num_workers * cfg.backend.nodes
        kept.capacity = cluster_capacity(choice.device)
        kept.make_room(key, workers_each)
        workers = ServeWorkers(cfg.backend, cfg.optimizer, cfg.trainer, str(model_path), plan.optimizer_values, choice,
                               WorkerOutput(run_dir / "workers.log"), model_cfg.lora)
        workers.ready()
        pids = [info["pid"] for info in workers.group.device_info()]
        return Kept(key, workers, time.time(), pids, resident_mb(pids), workers_each)

    def build_workers(rank: int, model_id: str) -> Any:
        """A client's model.

        A LoRA model takes a slot of its key's group (held, kept or built); a fully fine-tuned one the kept group of its
        key in a fresh state, exactly a new build's, else a new group."""
        model_cfg = replace(cfg, lora=replace(cfg.lora, rank=rank))
        key = group_key(model_cfg, model_path, choice, {}, worker=ServeWorkers.__name__)
        if rank:
            return on_slot(key, model_cfg, model_id)
        found = kept.find(key)
        if found is not None:
            workers = kept.take(found)
            workers.start_fresh(cfg.optimizer, cfg.trainer, plan.optimizer_values, workers.output)
            say("the new model trains on the kept workers (fresh state)")
            return Lent(workers, lambda: kept.add(found))
        group = new_group(key, model_cfg)
        group.workers.keep_initial_state()
        return Lent(group.workers, lambda: kept.add(group))

    def on_slot(key: dict, model_cfg, model_id: str) -> ServedSlot:
        """A slot of the key's group, filled as a new group's model starts (runtime/slots.py: the trainer's seed)."""
        name = KeptGroups.name(key)
        group = on_slots.get(name)
        how = "beside the models it holds"
        if group is None:
            found = kept.find(key)
            if found is not None:
                group, how = found, "kept warm"
                kept.take(found)
            else:
                group, how = new_group(key, model_cfg), "built for it"
                group.workers = ServedSlots(group.workers, serve.slots)
            on_slots[name] = group
        slot = group.workers.fill(cfg.optimizer, cfg.trainer, plan.optimizer_values, kind=ServedSlot)
        say(f"model {model_id} holds slot {slot.index + 1} of {serve.slots} on the group of LoRA rank {model_cfg.lora.rank} "
            f"({how})")

        def given_back() -> None:
            say(f"model {model_id}'s slot {slot.index + 1} is free")
            if not group.workers.slots:  # the group's last model: kept warm for the next clients'
                kept.add(on_slots.pop(name))

        slot.given_back = given_back
        return slot

    def optim_params(adam: dict) -> dict:
        return plan_for(adam, plan.optimizer_values, 1, plan.optimizer, float(cfg.optimizer.clip_grad or 0.0))[0]

    def make_sampler():
        from tinker_exp.runtime.serve_sampler import ServedSampler

        return ServedSampler(model_path, cfg.trainer.seed)

    def open_rows(folder: Path, first_step: int) -> Sinks:
        """A model's metrics.jsonl, in its own folder; the W&B run stays open.

        Reopened where a load_state rewinds it: rows of first_step and later are replaced, that model's only."""
        folder.mkdir(parents=True, exist_ok=True)
        return Sinks([JsonlSink(folder / "metrics.jsonl", first_step), wandb and KeptOpen(wandb)])

    server = Server(model_name, build_workers, optim_params, open_rows, check_applied, run_dir, make_sampler,
                    serve.max_chunk_datums, vocab_size=vocabulary_size(model_path), tokenizer_id=str(model_path.resolve()),
                    positions=model_positions(model_path), max_num_samples=serve.max_num_samples,
                    max_body_bytes=serve.max_body_bytes, slots=serve.slots)
    import uvicorn

    from tinker_exp.runtime.serve_workers import start_served_ray, stop_served_ray

    Stopped.watch()  # from here SIGTERM is Stopped: Ray's daemons, once started, are stopped below
    stopped = held = None
    try:
        # Ray from this (the main) thread, once: the worker groups join it, and it is shut down here when the server
        # stops. Started by the first model's build (the work thread), its signal handling was not set up (SIGTERM:
        # exit 134 or no stopped line) and its agents outlived the server.
        start_served_ray(cfg.backend.ray_address, choice.device)
        host, port = listener.getsockname()[:2]
        access = "requests must carry its key" if serve.api_key else "no key: any local user can reach it"
        print(f"tinker_exp.serve: serving {model_name} on http://{host}:{port} (run dir {run_dir}; {access})", flush=True)
        uvicorn.Server(uvicorn.Config(build_app(server, serve.api_key), log_level="warning",
                                      timeout_graceful_shutdown=1)).run(sockets=[listener])
    except (KeyboardInterrupt, Stopped) as e:
        stopped = e
    finally:
        try:
            held = server.close()  # the held models' workers given back, then freed with the kept ones
            for group in [*kept.forget_all(), *on_slots.values()]:
                group.workers.shutdown()
            if wandb is not None:  # the server stopped (Ctrl-C, SIGTERM): its W&B run ends
                wandb.close()
        finally:
            stop_served_ray()
    if stopped is not None:
        why, code = ("Ctrl-C", 130) if isinstance(stopped, KeyboardInterrupt) else ("SIGTERM", 143)
        freed = (f"model {held[0]}'s workers freed" if len(held) == 1 else
                 f"models {', '.join(held)} freed with their workers" if held else "no model held")
        print(f"tinker_exp.serve: stopped ({why}); {freed}", file=sys.stderr, flush=True)
        sys.exit(code)


class Lent:
    """A fully fine-tuned model's workers (a kept group's), as the server calls them.

    Freeing them (its session ended) calls `give_back` instead: the group kept for a later client's model of the same
    key (runtime/warm.py KeptGroups). (A LoRA model's slot says itself when it is freed: ServedSlot.given_back.)"""

    def __init__(self, workers: Any, give_back: Callable[[], None]) -> None:
        self._workers, self._give_back = workers, give_back

    def __getattr__(self, name: str):
        return getattr(self._workers, name)

    def shutdown(self) -> None:
        self._give_back()


class Stopped(Exception):
    """SIGTERM, once uvicorn has shut down (it raises the signal it caught again): ended as Ctrl-C is, in one line."""

    @classmethod
    def watch(cls) -> None:
        """Our handlers under uvicorn's: SIGTERM raises Stopped, SIGINT KeyboardInterrupt.

        uvicorn restores them, then raises the signal it caught. SIGINT raises even where the shell that started us
        ignores SIGINT (a command run with `&`)."""
        import signal

        def stop(signum, frame):
            raise cls()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def scrub_key(serve: ServeConfig) -> None:
    """The API key out of sight: blanked in sys.argv, out of the environment.

    The key given on the command line is blanked in sys.argv, which W&B records (wandb-metadata.json), and
    $TINKER_EXP_API_KEY leaves the environment, which Ray's workers would inherit."""
    import os

    os.environ.pop(API_KEY_ENV, None)
    if serve.api_key:
        sys.argv[:] = [arg if serve.api_key not in arg else arg.replace(serve.api_key, "(key)") for arg in sys.argv]


def served_wandb(cfg, composed, serve: ServeConfig, run_dir: Path):
    """With logger=wandb, the served run's W&B run (started in the background, as a run's); None otherwise.

    Each optim_step's row, as in metrics.jsonl, under the config a run would have, plus `serve.*`."""
    if not cfg.logger.wandb:
        return None
    import os
    from omegaconf import OmegaConf

    from tinker_exp.train.sinks import StartingSink, WandbSink, flat_config, wandb_environment

    os.environ.update(wandb_environment(run_dir, cfg.logger.mode.value))
    config = flat_config({**OmegaConf.to_container(composed, resolve=True), "serve": serve.public()})
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
    except KeyboardInterrupt:  # Ctrl-C before the server listens (composing, building the tiny model)
        print("tinker_exp.serve: stopped (Ctrl-C) before serving", file=sys.stderr)
        sys.exit(130)

