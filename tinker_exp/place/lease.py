"""A run's side of a warm pool: a `Lease`, the pool training the run in its own process.

Find one (`lease_a_pool`, per `backend.pool`), hold it for the run, hand it the run and show what it says (its log records,
the progress bar) as a cold run would show them; Ctrl-C and SIGTERM reach the run there, and it stops as a cold run
does. Pure Python: no torch, verl or ray in this process.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tinker_exp.errors import ConfigError, Terminated, TinkerExpError
from tinker_exp.formats import masked
import tinker_exp.place.wire as wire  # the wire alone: the seam (place/__init__.py) imports this module
from tinker_exp.place.this_process import ColdGroup

log = logging.getLogger(__name__)

STOP_WAIT_S = 30.0
"""After Ctrl-C or SIGTERM, how long the run waits for the pool to stop it and close its files."""
HEARTBEAT_S = 2.0
"""How often a run holding a pool says it is alive (the pool stops a run whose client says nothing for
host.LEASE_TIMEOUT_S: a stopped or hung client does not hold the pool for ever)."""


class PoolBusyError(TinkerExpError):
    """The pool is lending its workers to another run: one run at a time on a group."""

    exit_code = 2
    label = "pool busy"


class PoolGoneError(TinkerExpError):
    """The pool ended while it ran this run."""

    label = "pool error"


def sweep_addresses() -> list[Path]:
    return [Path(a) for a in os.environ.get(wire.SWEEP_POOLS_ENV, "").split(":") if a]


def lease_a_pool(cfg: Any, wait_for_slot: bool = False) -> "Lease | ColdGroup":
    """The pool this run trains on, held for it, or a cold start.

    backend.pool: none, auto or an address. auto: a free pool of this sweep's, else this user's pool if up, else a cold
    start (said in one line, when the run trains). A pool that is busy, runs older code, or is not this user's alone
    (`wire.connect`) is skipped (auto: the run starts cold, said in one line; an address: refused, one line, exit 2,
    nothing written); so is every pool for a run that joins a Ray cluster of its own (backend.ray_address). A LoRA SFT
    run asks for a slot: it trains beside the pool's other runs on slots when they share its group and its context
    (`slot_terms`); `wait_for_slot`: while they hold every slot, it waits for one (a sweep's trial) instead of being
    refused."""
    setting = cfg.backend.pool
    # A Slurm job trains in its own allocation: cold, unless it holds a pool of its own there (a study worker's).
    if setting == "none" or (setting == "auto" and "SLURM_JOB_ID" in os.environ and not sweep_addresses()):
        return ColdGroup()
    explicit = setting != "auto"
    if cfg.backend.ray_address:
        line = f"backend.ray_address={cfg.backend.ray_address}: the run joins that Ray cluster, and a pool runs its own"
        if explicit:
            raise ConfigError(f"backend.pool={setting}: {line} (backend.pool=none, or no backend.ray_address)")
        return ColdGroup(f"pool: {line}; starting cold")
    addresses = [Path(setting).expanduser()] if explicit else best_first(sweep_addresses(), cfg) or [wire.address_of()]
    answers: list[tuple[Path, Any]] = []
    for address in addresses:
        try:
            sock = wire.connect(address)
            wire.send(sock, ("lease", {"code": wire.code_fingerprint(), "pid": os.getpid(), "who": who(),
                                       "slot": slot_terms(cfg), "wait": wait_for_slot}))  # fmt: skip
            reply = wire.lease_answer(sock)
        except wire.UntrustedPool as e:
            if explicit:
                raise wire.UntrustedPool(f"backend.pool={setting}: {e}") from None
            answers.append((address, ("untrusted", str(e))))
            continue
        except (OSError, EOFError) as e:
            answers.append((address, ("none", str(e))))
            continue
        if reply[0] == "leased":
            sock.settimeout(None)
            return Lease(sock, address, reply[1])
        sock.close()
        answers.append((address, reply))
    busy = [(address, reply[1]) for address, reply in answers if reply[0] == "busy"]
    if busy:
        address, holder = busy[0]
        since = time.strftime("%H:%M:%S", time.localtime(holder["since"]))
        if explicit:
            raise PoolBusyError(
                f"backend.pool={setting}: the pool at {address} is running another run ({busy_with(holder)}, pid "
                f"{holder['pid']}, since {since}" + (f"; {holder['slots']}" if "slots" in holder else "")
                + "); one run at a time on its workers, or LoRA SFT runs of one group and one working dir and "
                "environment on its slots: run again when it ends, or with backend.pool=none (a cold start)"
            )
        on_slots = f"; {holder['slots']}" if "slots" in holder else ""
        return ColdGroup(f"pool: busy with {busy_with(holder)} (pid {holder['pid']}, since {since}{on_slots}), starting cold")
    untrusted = [reply[1] for _, reply in answers if reply[0] == "untrusted"]
    if untrusted:
        return ColdGroup(f"pool: not trusted, nothing sent to it: {untrusted[0]}; starting cold")
    stale = [address for address, reply in answers if reply[0] == "stale"]
    if stale:
        line = f"the pool at {stale[0]} runs the code of before a change: python -m tinker_exp.pool down, then up again"
        if explicit:
            raise ConfigError(f"backend.pool={setting}: {line}")
        return ColdGroup(f"pool: {line}; starting cold")
    if explicit:
        raise ConfigError(f"backend.pool={setting}: no pool answers there (python -m tinker_exp.pool up starts one)")
    return ColdGroup("pool: none is up, starting cold (python -m tinker_exp.pool up keeps workers warm between runs)")


def slot_terms(cfg: Any) -> dict[str, Any] | None:
    """What a pool needs to judge whether this run may share its group on a slot.

    Its config, the environment that reaches the workers, and its context (what the run sets process-wide there: the
    environment sent, the working dir, sys.path; runs on slots at once share it). None: a run that cannot train on a
    slot."""
    from tinker_exp.config.validate import why_not_on_slot

    if why_not_on_slot(cfg) is not None or cfg.env.active:  # a pool's slots hold LoRA SFT runs; an RL run leases it whole
        return None
    payload = run_payload((), cfg)
    context = (tuple(sorted(payload["environ"].items())), payload["cwd"], tuple(payload["sys_path"]))
    return {"config": cfg, "worker_env": payload["worker_env"], "context": context}


def busy_with(holder: dict[str, Any]) -> str:
    """The run a busy pool trains, as a refused run is told: its run dir, else its command line."""
    return holder.get("run_dir") or masked(holder["who"]) or "a run without overrides"


def best_first(addresses: list[Path], cfg: Any) -> list[Path]:
    """A sweep's pools in the order its job tries them.

    Free ones that keep a group for it first, then free ones that keep none, then the others (a pool that does not
    answer last); so jobs that mix LoRA ranks, say, each go to the pool that has their group instead of building it
    again on the first free one."""
    if len(addresses) < 2:
        return addresses
    request = {"code": wire.code_fingerprint(), "config": cfg, "worker_env": wire.worker_environment(dict(os.environ))}

    def rank(address: Path) -> int:
        try:
            answer = wire.ask(address, ("fits", request), timeout_s=10.0)
        except (OSError, EOFError, wire.UntrustedPool):
            return 4
        if not answer["free"]:
            return 3
        return 0 if answer["fits"] else 1 if answer["groups"] == 0 else 2

    return sorted(addresses, key=rank)


def who() -> str:
    """This run's command line as the pool shows it (`status`, a busy line): masked as every output is."""
    return masked(" ".join(sys.argv[1:]))


def needed_secrets(cfg: Any) -> tuple[str, ...]:
    """The secrets of the environment that the run itself uses.

    W&B's API key for an online W&B run, the Hub's token for a model it may download. No other secret is sent to the
    pool."""
    from tinker_exp.config.schema import WandbMode

    needed: tuple[str, ...] = ()
    if cfg.logger.wandb and cfg.logger.mode == WandbMode.online:
        needed += ("WANDB_API_KEY",)
    if cfg.model.path and not Path(cfg.model.path).expanduser().is_dir():
        needed += ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
    return needed


def run_payload(arguments: tuple, cfg: Any) -> dict[str, Any]:
    """What the pool needs besides the arguments to run as this process would.

    The environment the run needs (not the whole: `wire.sent_environment`), where its workers' part is the group's
    key; the working dir and sys.path it imports user code from (env.reward); its log level and whether its terminal
    is one."""
    environ = wire.sent_environment(dict(os.environ), needed_secrets(cfg))
    return {
        "arguments": arguments,
        "environ": environ,
        "worker_env": wire.worker_environment(environ),
        "cwd": os.getcwd(),
        "sys_path": list(sys.path),
        "log_level": logging.getLogger().getEffectiveLevel(),
        "isatty": sys.stderr.isatty(),
    }


class RemoteError(Exception):
    """An error that is not ours, raised in the pool's run.

    Its traceback as the pool saw it. (Not a frozen dataclass: Python sets an exception's __traceback__ as it passes
    through a `with`.)"""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"in the pool's run:\n{self.text}"


class Lease:
    """This run's hold on a pool: released when the run ends (or this process does)."""

    def __init__(self, sock: Any, address: Path, info: dict[str, Any]) -> None:
        self.sock, self.address, self.info = sock, address, info
        self.sending = threading.Lock()
        self.released = threading.Event()
        threading.Thread(target=self._heartbeat, name="pool-heartbeat", daemon=True).start()

    def send(self, message: Any) -> None:
        with self.sending:
            wire.send(self.sock, message)

    def _heartbeat(self) -> None:
        while not self.released.wait(HEARTBEAT_S):
            try:
                self.send(("alive",))
            except OSError:
                return

    def describe(self) -> str:
        return ""  # the pool says where the run trains, once it knows (runtime/warm.py WarmGroups.lend)

    @property
    def workers_log(self) -> Path | None:
        """Where the workers print.

        On a slot, the pool's own folder (its runs on slots share them); else None (the run dir's, as a cold run's)."""
        from tinker_exp.assemble import WORKERS_LOG

        return wire.workers_dir_of(self.address) / WORKERS_LOG if self.info.get("slot") else None

    def check(self, cfg: Any, rows: Any, start: Any) -> None:
        """The run's inputs checked by the pool as a cold run checks them here, before the run's record is written.

        Its device, model, LoRA targets, tokenized data. A refusal is one line and writes nothing. The rows (an env: its
        prompt rows and its reward's spec) go as this process read and checked them, packed: unpacked in the run's
        context there, where the reward imports from the client's folder; the pool keeps what it checked for the run's
        training."""
        checked = pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)
        self.send(("check", run_payload((cfg, start, checked), cfg)))
        try:
            self.follow()
        except (KeyboardInterrupt, Terminated) as stop:
            self._stop("SIGINT" if isinstance(stop, KeyboardInterrupt) else "SIGTERM")
            raise

    def train_run(self, cfg: Any, plan: Any, rows: Any, start: Any, run_dir: Path, wandb_config: dict[str, Any],
                  place: Any, job_number: int | None) -> dict[str, Any]:  # fmt: skip
        """run.train_run, run by the pool on its workers; its result, or what it raised, here.

        `place` is this lease; the inputs are those its `check` kept. The plan is built there again from the config (a
        plan holds compiled schedules, which do not travel)."""
        self.send(("run", run_payload((cfg, start, run_dir, wandb_config, job_number), cfg)))
        try:
            return self.follow()
        except (KeyboardInterrupt, Terminated) as stop:
            self._stop("SIGINT" if isinstance(stop, KeyboardInterrupt) else "SIGTERM")
            raise

    def follow(self) -> Any:
        """What the pool says until it is done: shown here as a cold run shows it; its result, or its error raised."""
        while True:
            try:
                message = wire.recv(self.sock)
            except (EOFError, OSError) as e:
                raise PoolGoneError(f"the pool at {self.address} ended during the run ({e}); its log: {wire.log_of(self.address)}") from None
            kind = message[0]
            if kind == "log":
                record = logging.makeLogRecord(message[1])
                # this run's record now, in the thread that follows it (a sweep's trial routes its records by thread)
                record.thread, record.threadName = threading.get_ident(), threading.current_thread().name
                logger = logging.getLogger(record.name)
                if logger.isEnabledFor(record.levelno):
                    logger.handle(record)
            elif kind in ("stdout", "stderr"):
                stream = getattr(sys, kind)
                stream.write(message[1])
                stream.flush()
            elif kind == "done":
                return message[1]
            elif kind == "raised":
                raise message[1]
            elif kind == "crashed":
                raise RemoteError(message[1])

    def ask_stop(self) -> None:
        """Ctrl-C for the run in the pool, from another thread (a sweep's trial cancelled).

        It stops at its next step, and its `follow` raises KeyboardInterrupt."""
        try:
            self.send(("stop", "SIGINT"))
        except OSError:
            pass

    def _stop(self, signal_name: str) -> None:
        """Ctrl-C or SIGTERM here.

        The same reaches the run in the pool, which closes it as a cold run closes; its lines are shown until it has
        (bounded)."""
        try:
            self.send(("stop", signal_name))
            self.sock.settimeout(STOP_WAIT_S)
            self.follow()
        except BaseException:  # its stop (KeyboardInterrupt, Terminated), or a pool that does not answer in time
            pass

    def release(self) -> None:
        self.released.set()
        try:
            self.sock.close()
        except OSError:
            pass
