"""Pool processes on this machine: started, asked whether they answer, ended; and a sweep's own pools.

Pool processes are started by `start_host`. A sweep's own pools (`SweepPools`): one per job the sweep runs at once,
started before its first job and ended with it.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from tinker_exp.errors import TinkerExpError
from tinker_exp.place import wire

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
"""How long a new pool's process may take to listen."""
SWEEP_IDLE_S = 3600.0
"""A sweep's pool ends with its sweep (or when the sweep's process is gone); this bounds it if neither is seen."""


class PoolStartError(TinkerExpError):
    label = "pool error"


def answers(address: Path) -> bool:
    try:
        return wire.ask(address, ("status",), timeout_s=2.0)["pid"] > 0
    except (OSError, EOFError):
        return False


def start_host(address: Path, idle_s: float, parent_pid: int | None = None, wait: bool = True,
               host_args: Sequence[str] = ()) -> subprocess.Popen:  # fmt: skip
    """The pool's process, in a session of its own; returns once it listens (`wait`).

    A terminal's Ctrl-C is for runs, not for it. Its output goes to its log beside the socket. `parent_pid`: it ends
    when that process has; `host_args`: the bounds of the groups it keeps (pool/__main__.py UpOptions.host_args; none:
    the defaults)."""
    wire.make_private(address.parent)
    log_path = wire.log_of(address)
    with open(log_path, "ab") as log_file:
        command = [sys.executable, "-m", "tinker_exp.pool", "_host", str(address), str(idle_s), str(parent_pid or 0)]
        process = subprocess.Popen(
            command + list(host_args or ("0", "0")),
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, start_new_session=True,
        )  # fmt: skip
    if wait:
        wait_listening(process, address)
    return process


def wait_listening(process: subprocess.Popen, address: Path) -> None:
    log_path = wire.log_of(address)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not answers(address):
        if process.poll() == wire.ALREADY_EXIT and wire.pid_holding(address) is not None:
            pass  # another `up` started one at the same time: that one serves; wait for it to listen
        elif process.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            raise PoolStartError(f"the pool's process ended (exit {process.returncode}) before it listened; {log_path}:\n{tail}")
        if time.monotonic() > deadline:
            process.kill()
            raise PoolStartError(f"the pool did not listen within {START_TIMEOUT_S:.0f} s; its log: {log_path}")
        time.sleep(0.2)




def end(address: Path, process: subprocess.Popen | None = None, wait_s: float = 60.0) -> int | None:
    """Ask the pool at `address` to end, and wait until its process has; its pid, or None if none answered.

    Its child `process`: reaped."""
    try:
        _, pid = wire.ask(address, ("down",))
    except (OSError, EOFError):
        pid = wire.pid_holding(address)  # a pool still starting (not listening yet): its SIGTERM stops it once it can
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pid = None
    if process is not None:
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            log.info(f"pool: the pool at {address} (pid {process.pid}) had not ended {wait_s:g} s after it was asked: killed")
            address.unlink(missing_ok=True)  # what its own end would have removed: a killed pool's socket answers nobody
        return pid
    deadline = time.monotonic() + wait_s
    while pid is not None and wire.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pid


class SweepPools:
    """A sweep's own pools.

    `count` of them on this machine, each serving one of its jobs at a time, reached by the jobs through SWEEP_POOLS_ENV
    (`backend.pool=auto` takes a free one). Their processes are this sweep's children: ended by `close` (called at exit
    too, after Ctrl-C or a failed job) or, should this process be killed, by themselves once it is gone."""

    def __init__(self) -> None:
        self.processes: list[tuple[Path, subprocess.Popen]] = []
        self.code = ""
        """tinker_exp's code when they started (wire.code_fingerprint)."""

    def __getstate__(self) -> dict[str, Any]:
        return {"processes": [], "code": ""}  # a copy (a job's pickled launcher) holds none: only the sweep ends its pools

    def stale(self) -> bool:
        """Whether tinker_exp's code changed since the pools started (a run would skip them as stale)."""
        return bool(self.processes) and wire.code_fingerprint() != self.code

    def start(self, count: int) -> None:
        if self.processes or count < 1:
            return
        self.code = wire.code_fingerprint()
        folder = wire.pool_dir()
        wire.make_private(folder)
        addresses = [folder / f"sweep-{os.getpid()}-{i}.sock" for i in range(count)]
        log.info(f"pool: {count} warm pool(s) for this sweep's jobs (backend.pool=auto): {', '.join(map(str, addresses))}")
        self.processes = [(a, start_host(a, SWEEP_IDLE_S, os.getpid(), wait=False)) for a in addresses]
        atexit.register(self.close)
        for address, process in self.processes:
            wait_listening(process, address)
        os.environ[wire.SWEEP_POOLS_ENV] = ":".join(map(str, addresses))

    def close(self) -> None:
        processes, self.processes = self.processes, []
        if not processes:
            return
        os.environ.pop(wire.SWEEP_POOLS_ENV, None)
        for address, process in processes:
            end(address, process)
        log.info(f"pool: the sweep's {len(processes)} pool(s) ended")


def slot_pool(setting: str) -> tuple[Path, int] | None:
    """(address, slots) of the warm pool whose slots a sweep's trials on slots train on; None: none.

    Used by place/__init__.py `choose`: the one their backend.pool names, or with auto the user's own, when it answers
    and keeps more than one slot; None: they train on a group the sweep's process builds."""
    if setting == "none":
        return None
    address = wire.address_of() if setting == "auto" else Path(setting).expanduser()
    try:
        slots = int(wire.ask(address, ("status",), timeout_s=2.0).get("slots", 1))
    except (OSError, EOFError, wire.UntrustedPool):
        return None
    return (address, slots) if slots > 1 else None


def wanted(configs: Sequence[Any]) -> bool:
    """Whether a sweep's jobs would take a sweep pool: their backend.pool is auto (none: cold; an address: that pool)."""
    return any(cfg is not None and cfg.backend.pool == "auto" and cfg.backend.nodes == 1 and not cfg.dry_run for cfg in configs)


def named(configs: Sequence[Any]) -> bool:
    """Whether every one of a sweep's jobs trains on the pool its backend.pool names (an address).

    Each leases it as a job on the sweep's pools does."""
    return bool(configs) and all(cfg is not None and cfg.backend.pool not in ("auto", "none") and cfg.backend.nodes == 1
                                 and not cfg.dry_run for cfg in configs)  # fmt: skip


def named_pools(configs: Sequence[Any]) -> int:
    """How many pools a sweep's jobs name when every job names one (`named`), else 0.

    A pool trains one run at a time (LoRA runs on its slots aside): that many jobs at once, as a job beyond them would
    be refused (pool busy)."""
    return len({str(cfg.backend.pool) for cfg in configs}) if named(configs) else 0
