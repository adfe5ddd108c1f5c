"""One process per run dir: a lock file, created with O_EXCL, that names its holder and carries a heartbeat.

Two processes in one run dir (a manual rerun beside a requeued Slurm job, two sweep points given one dir) would both
train into the same metrics.jsonl and checkpoints. The run dir may sit on NFS or Lustre, seen by several Slurm
nodes, where fcntl/flock locks are not reliable; O_EXCL creation is atomic there. The file says who holds it (host,
pid, the process's start time, Slurm job id and restart count, since when); a daemon thread refreshes its mtime
every HEARTBEAT_S. A holder that died without releasing it (SIGKILL, a lost node) does not leave the dir stuck: see
:func:`takeover_reason`. Pure Python (stdlib).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from tinker_exp import threads
from tinker_exp.errors import ConfigError

LOCK_FILE = "tinker_exp.lock"
"""In the run dir while a run (or a dry run) holds it; removed when it ends, however it ends (but SIGKILL)."""
POOL_RELEASE_WAIT_S = 90.0
"""A run whose dir's holder is gone while a warm pool still trains its run there (its client was killed) waits this
long for the pool to stop that run and release the dir, then is refused."""
HEARTBEAT_S = 10.0
"""How often the holder refreshes the lock file's mtime."""
STALE_AFTER_S = 120.0
"""A lock of another host whose mtime is older than this is taken over: its holder is taken to be dead. Well over
HEARTBEAT_S, because NFS clients cache file attributes for up to 60 s, and hosts' clocks differ by a little."""
log = logging.getLogger(__name__)


class RunDirInUse(ConfigError):
    """Another live process holds the run dir. Raised before this process writes anything into it."""

    label = "run dir in use"


@dataclass(frozen=True)
class Holder:
    """Who holds (or wants) a run dir: the lock file's content."""

    host: str
    """socket.gethostname() of the holder."""
    pid: int
    """Its process id, on `host`."""
    started: int | None
    """Its process's start time (clock ticks since boot, /proc/PID/stat), to tell a reused pid; None off Linux."""
    since: str
    """When it took the lock (UTC)."""
    token: str
    """Random, one per lock taken: tells this lock from a later one of the same process."""
    slurm_job_id: str | None = None
    """SLURM_JOB_ID, when it runs under Slurm."""
    slurm_restarts: int = 0
    """SLURM_RESTART_COUNT: how often Slurm requeued that job (0: never)."""
    pool_pid: int | None = None
    """The warm pool's process (on `host`) that trains this holder's run and writes into the dir, while it does."""
    pool_started: int | None = None
    """That process's start time (as `started`)."""

    @classmethod
    def me(cls, environ: Mapping[str, str] = os.environ) -> "Holder":
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=process_started(os.getpid()),
            since=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            token=secrets.token_hex(8),
            slurm_job_id=environ.get("SLURM_JOB_ID") or None,
            slurm_restarts=int(environ.get("SLURM_RESTART_COUNT") or 0),
        )

    def describe(self) -> str:
        slurm = ""
        if self.slurm_job_id:
            slurm = f", Slurm job {self.slurm_job_id}" + (f" (restart {self.slurm_restarts})" if self.slurm_restarts else "")
        pool = f", trained by the warm pool (pid {self.pool_pid})" if self.pool_pid else ""
        return f"host {self.host}, pid {self.pid}{slurm}{pool}, since {self.since}"

    def pool_writes(self, started: Callable[[int], int | None]) -> bool:
        """Whether a warm pool of this host still trains this holder's run (whatever became of the holder)."""
        return self.pool_pid is not None and self.host == socket.gethostname() and started(self.pool_pid) == self.pool_started


def process_started(pid: int) -> int | None:
    """The start time of a running process of this host (clock ticks since boot).

    None when there is none with this pid, or it is a zombie (killed, not yet waited for). Off Linux (no /proc): 0 for
    any live pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return _alive_without_proc(pid)
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": the command name may hold spaces
    state, start_ticks = fields[0], int(fields[19])
    return None if state in ("Z", "X") else start_ticks


def _alive_without_proc(pid: int) -> int | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # someone else's process: alive
    return 0


def takeover_reason(holder: Holder, me: Holder, heartbeat_age_s: float, started: Callable[[int], int | None]) -> str | None:
    """Why `me` may take the lock that `holder` left (its mtime `heartbeat_age_s` old), or None: the holder lives.

    `started(pid)`: that pid's start time on this host (:func:`process_started`). The rules, in order:
    - the same Slurm job, requeued since (a higher restart count; the old start may still be dying, anywhere);
    - this host, and the pid is gone, or now another process (another start time);
    - another host, and the heartbeat is older than STALE_AFTER_S."""
    if holder.pool_writes(started):
        return None  # its client may be gone; the pool still writes into the dir until it releases it
    same_job = holder.slurm_job_id is not None and holder.slurm_job_id == me.slurm_job_id
    if same_job and me.slurm_restarts > holder.slurm_restarts:
        return f"Slurm requeued job {me.slurm_job_id} (restart {holder.slurm_restarts} -> {me.slurm_restarts})"
    if holder.host == me.host:
        now = started(holder.pid)
        if now is None:
            return f"pid {holder.pid} is gone"
        if holder.started is not None and now and now != holder.started:
            return f"pid {holder.pid} is another process now"
        return None
    if heartbeat_age_s > STALE_AFTER_S:
        return f"no heartbeat for {heartbeat_age_s:.0f} s (> {STALE_AFTER_S:.0f} s)"
    return None


def read_holder(path: Path) -> tuple[Holder | None, float] | None:
    """The lock's holder (None: not readable as one) and its heartbeat's age in seconds; None when there is no lock."""
    try:
        with open(path, encoding="utf-8") as file:
            age = time.time() - os.fstat(file.fileno()).st_mtime
            text = file.read()
    except FileNotFoundError:
        return None
    try:
        return Holder(**json.loads(text)), age
    except (ValueError, TypeError):
        return None, age


class RunDirLock:
    """`with RunDirLock(run_dir):` holds the run dir exclusively, or raises RunDirInUse naming the holder."""

    def __init__(self, run_dir: Path, environ: Mapping[str, str] = os.environ):
        self.path = run_dir / LOCK_FILE
        self.me = Holder.me(environ)
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def __enter__(self) -> "RunDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        turns = 5  # each turn: create it, or judge its holder (another contender may change it meanwhile)
        for turn in range(turns):
            if self._create():
                self._heartbeat = threads.start(self._beat, "run-dir-lock-heartbeat")  # its warnings are the run's
                return
            found = read_holder(self.path)
            if found is None:
                continue  # released meanwhile
            holder, age = found
            if holder is None:  # not (yet) readable: its holder writes its one line right after creating it
                if age <= STALE_AFTER_S:
                    if turn < turns - 1:
                        time.sleep(0.1)
                        continue
                    raise RunDirInUse(
                        f"{self.path.parent} is held by {self.path}, which is not readable: wait, or remove it if no run uses the dir"
                    )
                reason = f"unreadable, no heartbeat for {age:.0f} s"
            else:
                reason = takeover_reason(holder, self.me, age, process_started)
                if reason is None and holder.pool_writes(process_started) and process_started(holder.pid) is None:
                    self._wait_for_pool(holder)  # its client was killed: the pool stops the run and releases the dir
                    continue
                if reason is None:
                    where, who = self.path.parent, holder.describe()
                    raise RunDirInUse(f"{where} is held by {who}: wait for it to end, or use another run dir")
            if self._remove_stale(holder):
                log.warning(f"run dir lock of {holder.describe() if holder else 'an unknown holder'} taken over: {reason}")
        raise RunDirInUse(f"{self.path.parent}: its lock kept changing hands; try again")

    def _wait_for_pool(self, holder: Holder) -> None:
        """Wait until the pool training `holder`'s run (whose process is gone) has released the dir.

        RunDirInUse after POOL_RELEASE_WAIT_S."""
        log.info(f"{self.path.parent}: its run (pid {holder.pid}) is gone, and the warm pool (pid {holder.pool_pid}) still "
                 "stops it there: waiting for the pool to release the dir")  # fmt: skip
        deadline = time.monotonic() + POOL_RELEASE_WAIT_S
        while time.monotonic() < deadline:
            found = read_holder(self.path)
            if found is None or found[0] is None or found[0].token != holder.token or not found[0].pool_writes(process_started):
                return
            time.sleep(0.2)
        raise RunDirInUse(f"{self.path.parent}: the warm pool (pid {holder.pool_pid}) still writes into it after "
                          f"{POOL_RELEASE_WAIT_S:.0f} s; wait for it (python -m tinker_exp.pool status), or use another run dir")  # fmt: skip

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(json.dumps(asdict(self.me)) + "\n")
        return True

    def _remove_stale(self, judged: Holder | None) -> bool:
        """Move the stale lock aside under a unique name (one contender's rename wins), and check what was moved.

        What was moved must be the lock judged: another contender may have taken it over in between, and then it is put
        back."""
        aside = self.path.with_name(f"{LOCK_FILE}.stale.{self.me.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        found = read_holder(aside)
        moved = found[0] if found else None
        if judged is not None and (moved is None or moved.token != judged.token):
            try:
                os.link(aside, self.path)  # a live lock goes back, unless yet another run took the dir meanwhile
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        return True

    def holds(self) -> bool:
        found = read_holder(self.path)
        return found is not None and found[0] is not None and found[0].token == self.me.token

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self.holds():
                found = read_holder(self.path)
                by = found[0].describe() if found and found[0] else "nobody"
                log.warning(f"{self.path}: this run no longer holds its run dir (the lock is held by {by})")
                return
            try:
                os.utime(self.path)
            except OSError as e:  # a file system hiccup: the next beat tries again
                log.warning(f"{self.path}: heartbeat failed: {e}")

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        found = read_holder(self.path)
        holder = found[0] if found else None
        if holder is not None and holder.token == self.me.token and not holder.pool_writes(process_started):
            self.path.unlink(missing_ok=True)  # (a pool still stopping this run removes it when it has: written_by_pool)


@contextmanager
def written_by_pool(run_dir: Path, client_pid: int | None) -> Iterator[None]:
    """A warm pool's hold on a run dir its client locked.

    The lock says the pool (this process) writes into it, so a rerun after a killed client waits for the pool instead of
    taking the dir over; at the end the pool's mark goes (and the lock with it when the client is gone: no one else
    would remove it)."""
    path = run_dir / LOCK_FILE
    found = read_holder(path)
    holder = found[0] if found else None
    if holder is None or holder.pid != client_pid or holder.host != socket.gethostname():
        yield  # not locked by that client here (a test's own run): nothing to mark
        return
    marked = replace(holder, pool_pid=os.getpid(), pool_started=process_started(os.getpid()))
    _rewrite(path, marked)
    try:
        yield
    finally:
        found = read_holder(path)
        if found is not None and found[0] is not None and found[0].token == holder.token:
            if process_started(holder.pid) is None:
                path.unlink(missing_ok=True)
            else:
                _rewrite(path, holder)


def _rewrite(path: Path, holder: Holder) -> None:
    """The lock's content replaced at once (its holder's heartbeat and release see the same token)."""
    tmp = path.with_name(f"{LOCK_FILE}.{holder.token}.tmp")
    tmp.write_text(json.dumps(asdict(holder)) + "\n", encoding="utf-8")
    os.replace(tmp, path)
