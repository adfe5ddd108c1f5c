"""The pool's process: a Ray cluster and a warm worker group held across runs, each run trained by `run.train_run`.

torch, verl and Ray are imported once, a Ray cluster and a warm worker group (runtime/warm.py) held across runs, and
each run a client hands it trained here by `run.train_run`, the very code a cold run runs, with its log records,
progress bar and errors sent back to the client's terminal.

One run at a time on a group (a second client is refused while one holds the pool), executed in this process's
main thread, so a client's Ctrl-C or SIGTERM (or its end: a killed client) stops it as a cold run stops
(KeyboardInterrupt, Terminated); the group then starts the next run from its kept state. The exception: LoRA SFT runs
on a pool with `slots` > 1 each train on a slot of their key's group (runtime/slots.py), several at once when they
share what a run sets process-wide here (the environment sent, the working dir, sys.path: one process's sweep trials,
say); each runs in a thread of its own, its output and log records routed to its client by thread, and a stop
reaches it at its next step (`Sharing`). Idle for `idle_s`, or asked (`down`), the pool frees its workers and ends.
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from tinker_exp import threads
from tinker_exp.errors import STOPS, Terminated
from tinker_exp.place import wire
from tinker_exp.train.rundir_lock import written_by_pool
from tinker_exp.train.sinks import end_wandb_service
from tinker_exp.train.signals import SIGTERM_RECEIVED, sigterm_raises

log = logging.getLogger(__name__)

ENDING_WAIT_S = 60.0
"""How long a new run waits for a stopped or killed one to close its files and give the workers back."""
STOP_SIGNAL = signal.SIGUSR1
"""What a client's SIGTERM becomes in this process, only while a run runs (a late one, after the run, is ignored)."""
SLOTS = 4
"""LoRA SFT runs a user's pool trains at once on one group (`pool up --slots`); a sweep's own pools keep 1 (a pool a
job: the sweep runs its jobs at once on its pools)."""
LEASE_TIMEOUT_S = 60.0
"""A client that holds the pool and says nothing (not even its heartbeat, client.HEARTBEAT_S) for this long is taken
for gone: its run is stopped as on SIGTERM and the pool is free again. TINKER_EXP_POOL_LEASE_TIMEOUT_S sets it."""
LEASE_TIMEOUT_ENV = "TINKER_EXP_POOL_LEASE_TIMEOUT_S"
WATCH_POLL_S = 0.5
"""How often a run's watch looks at the time between its client's messages (its stop, its heartbeat)."""


@dataclass(eq=False)
class Job:
    """A request for the main thread.

    A run (`kind` "run"), its inputs checked before the client records it ("check"), or a group built ahead of runs
    ("prepare", from `up`)."""

    kind: str
    payload: dict[str, Any]
    sock: socket.socket
    done: threading.Event = field(default_factory=threading.Event)
    running: bool = False
    cancelled: bool = False
    sharing: "Sharing | None" = None
    """A run on a slot (and its check): in a thread of its own, stopped by `stop` at its next step."""
    stop: threading.Event = field(default_factory=threading.Event)
    kept: dict[str, Any] = field(default_factory=dict)
    """What the lease's check kept for its run (a run on a slot: its inputs, `checked`)."""


@dataclass
class Sharing:
    """LoRA SFT runs training at once, each on a slot of one group.

    Its key, the context they share (what a run sets process-wide here: the environment sent, the working dir,
    sys.path), who holds a slot, and while any of them runs, that context entered and each running thread's client (its
    output and log records go there)."""

    key: dict[str, Any]
    context: tuple
    holders: list[dict[str, Any]] = field(default_factory=list)
    jobs: set = field(default_factory=set)
    router: threads.Router = field(default_factory=threads.Router)
    entered: ExitStack | None = None


class Host:
    def __init__(self, address: Path, idle_s: float, parent_pid: int | None = None, max_groups: int | None = None,
                 memory_mb: float | None = None, slots: int = 1) -> None:  # fmt: skip
        """The pool's host: its kept groups' bounds and how many LoRA SFT runs train at once on a group.

        `max_groups`, `memory_mb`: the kept groups' bounds (runtime/warm.py KeptGroups; None: the defaults); `slots`:
        LoRA SFT runs trained at once on a group (1: one run at a time, each on the group itself)."""
        from tinker_exp import assemble
        from tinker_exp.runtime.warm import MAX_GROUPS, WarmGroups

        def build(cfg, plan, model_path, run_dir, choice):
            return assemble.verl_workers(cfg, plan, model_path, run_dir, choice)

        self.address, self.idle_s, self.parent_pid = address, idle_s, parent_pid
        self.group = WarmGroups(build, assemble.WORKERS_LOG, max_groups or MAX_GROUPS, memory_mb, where=str(address))
        self.code = wire.code_fingerprint()
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.lock = threading.RLock()
        self.free = threading.Condition(self.lock)
        """Notified when the pool's holder lets go."""
        self.holder: dict[str, Any] | None = None  # who holds the pool alone: {"who", "pid", "since"}
        self.slots = slots
        self.sharing: Sharing | None = None
        """Runs on slots, while any holds one (then `holder` is None)."""
        self.building = threading.Lock()  # one slot group's build at a time; the others wait for it
        self.current: Job | None = None
        self.started, self.last_used = time.time(), time.monotonic()
        self.stopping = threading.Event()
        self.main_thread = threading.main_thread().ident
        self.lease_timeout_s = float(os.environ.get(LEASE_TIMEOUT_ENV) or LEASE_TIMEOUT_S)

    # -- the listener: one thread a connection -------------------------------------------------------------------
    def listen(self) -> socket.socket:
        if self.address.exists():
            self.address.unlink()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(self.address))
        os.chmod(self.address, 0o600)
        server.listen(16)
        threading.Thread(target=self._accept, args=(server,), name="pool-accept", daemon=True).start()
        return server

    def _accept(self, server: socket.socket) -> None:
        while not self.stopping.is_set():
            try:
                sock, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), name="pool-client", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with sock:
            try:
                uid = wire.peer_uid(sock)
                if uid is not None and uid != os.getuid():  # only this user's processes (the folder is private too)
                    return
                message = wire.recv(sock)
                kind = message[0]
                if kind == "status":
                    wire.send(sock, self.status())
                elif kind == "down":
                    wire.send(sock, ("ok", os.getpid()))
                    self.stop("asked (pool down)")
                elif kind == "fits":  # a sweep's job choosing among its pools (client.attach)
                    wire.send(sock, self.fits(message[1]))
                elif kind in ("lease", "prepare"):
                    self._lend(sock, kind, message[1])
            except (EOFError, OSError):
                pass

    def _lend(self, sock: socket.socket, kind: str, request: dict[str, Any]) -> None:
        if request.get("code") != self.code:
            wire.send(sock, ("stale", self.code))
            return
        wanted = self._slot_terms(request) if kind == "lease" else None
        holder = {"who": request.get("who", ""), "pid": request.get("pid"), "since": time.time(), "ending": False}
        with self.free:
            # A run whose client has gone (killed) or stopped it is ending: the next one waits for it, not refused.
            self._wait_told(sock, lambda: self.holder is None or not self.holder["ending"], "the run before to end", ENDING_WAIT_S)
            if request.get("wait") and wanted is not None:  # a sweep's trial: waits for a slot of its sweep's runs
                self._wait_told(sock, lambda: self.stopping.is_set() or not self._all_taken_by_peers(wanted), "a slot", None)
            sharing = self._admit(wanted)
            if sharing is None and (self.holder is not None or self.sharing is not None or self.stopping.is_set()):
                wire.send(sock, ("busy", self._busy_info(wanted)))
                return
            if sharing is None:
                self.holder = holder
            else:
                sharing.holders.append(holder)
        job = None
        try:
            wire.send(sock, ("leased", {"pid": os.getpid(), "since": self.started, "slot": sharing is not None, "slots": self.slots}))
            if kind == "prepare":
                job = Job("prepare", request, sock)
            else:
                sock.settimeout(self.lease_timeout_s)  # the client checks and records its run first; alive meanwhile
                message = wire.recv(sock)
                kept: dict[str, Any] = {"pid": request.get("pid"), "holder": holder}  # its check's inputs join it
                while message[0] in ("alive", "check"):
                    after = None
                    if message[0] == "check":  # its inputs, checked here before the client writes its record
                        job = Job("check", message[1], sock, sharing=sharing, kept=kept)
                        self._start(job)
                        after = self._watch(sock, job)  # the client's next message may come before the check's end
                        job = None
                        sock.settimeout(self.lease_timeout_s)
                    message = after or wire.recv(sock)
                if message[0] != "run":
                    return
                job = Job("run", message[1], sock, sharing=sharing, kept=kept)
                holder["run_dir"] = str(message[1]["arguments"][2])  # what a run refused as busy is told
            self._start(job)
            self._watch(sock, job)
        except socket.timeout:
            log.info(f"pool: the client (pid {request.get('pid')}) said nothing for {self.lease_timeout_s:g} s; its lease ended")
        except (EOFError, OSError):  # the client has gone (killed): its run stops as on SIGTERM
            if job is not None:
                self._stop_job(job, STOP_SIGNAL)
        finally:
            if job is not None:
                job.done.wait()
            with self.free:
                if sharing is None:
                    self.holder = None
                else:
                    sharing.holders.remove(holder)
                    if not sharing.holders:
                        self.sharing = None
                self.free.notify_all()
            self.last_used = time.monotonic()

    def _wait_told(self, sock: socket.socket, ready: Any, what: str, bound_s: float | None) -> None:
        """Under `free`: wait until `ready()` (at most `bound_s`), the client told first that it waits and for how long.

        We tell it how long we may wait, so that it waits for our answer that long (wire.lease_answer), not its
        connection's timeout."""
        if not ready():
            wire.send(sock, ("waiting", {"for": what, "bound_s": bound_s}))
        self.free.wait_for(ready, timeout=bound_s)

    def _slot_terms(self, request: dict[str, Any]) -> tuple[dict[str, Any], tuple] | None:
        """(its group's key, its context) for a run that may train on a slot here, else None.

        None for a pool of one slot, a run that is not LoRA SFT on one node (its client says: `slot`), or one this pool
        cannot judge (its own checks then say why)."""
        wanted = request.get("slot")
        if self.slots < 2 or not wanted:
            return None
        try:
            from tinker_exp.runtime.inputs import model_dir
            from tinker_exp.runtime.warm import group_key

            cfg = wanted["config"]
            key = group_key(cfg, model_dir(cfg.model), self.group.choice(cfg), wanted["worker_env"])
        except Exception:
            return None
        return key, tuple(wanted["context"])

    def _admit(self, wanted: tuple[dict[str, Any], tuple] | None) -> "Sharing | None":
        """Under `free`: the sharing a run on a slot joins (begun for it when the pool is free), or None.

        None: the pool held alone, or busy (the caller tells which)."""
        if wanted is None or self.holder is not None or self.stopping.is_set():
            return None
        if self.sharing is None:
            self.sharing = Sharing(*wanted)
            return self.sharing
        if self._full_for(wanted):
            log.info(f"pool: a run on a slot refused: {self._why_not_beside(wanted)}")
            return None
        return self.sharing

    def _why_not_beside(self, wanted: tuple[dict[str, Any], tuple]) -> str:
        """Why a run like `wanted` cannot take a slot beside the runs on slots now (pool.log's line)."""
        from tinker_exp.runtime.warm import key_difference

        sharing = self.sharing
        if sharing.key != wanted[0]:
            return f"the runs on slots train another group ({key_difference(sharing.key, wanted[0])})"
        if sharing.context != wanted[1]:
            (env, cwd, path), (other_env, other_cwd, other_path) = sharing.context, wanted[1]
            differs = sorted(k for k in dict(env).keys() | dict(other_env).keys() if dict(env).get(k) != dict(other_env).get(k))
            return ("the runs on slots come from another " + ("working dir" if cwd != other_cwd else "sys.path" if path != other_path
                    else f"environment ({', '.join(differs)})"))  # fmt: skip
        return f"all {self.slots} slots are held"

    def _full_for(self, wanted: tuple[dict[str, Any], tuple]) -> bool:
        """Whether the runs on slots now leave none for a run like `wanted` (of another group or context: none)."""
        sharing = self.sharing
        if sharing is None:
            return self.holder is not None
        return (sharing.key, sharing.context) != wanted or len(sharing.holders) >= self.slots

    def _all_taken_by_peers(self, wanted: tuple[dict[str, Any], tuple]) -> bool:
        """Whether every slot is held by runs that a run like `wanted` could share with (it waits for one of them)."""
        sharing = self.sharing
        return sharing is not None and (sharing.key, sharing.context) == wanted and len(sharing.holders) >= self.slots

    def _busy_info(self, wanted: tuple[dict[str, Any], tuple] | None) -> dict[str, Any]:
        """Who a refused run is told holds the pool: its run alone, or the runs on its slots and how many.

        `wanted`: the refused run's slot terms, None for a run that needs the whole group. The line also says why this
        run cannot join the runs on the slots."""
        if self.holder is not None:
            return self.holder
        if self.sharing is not None and self.sharing.holders:
            why = ("this run needs the whole group (slots hold LoRA SFT runs on one node)" if wanted is None
                   else None if self._all_taken_by_peers(wanted) else self._why_not_beside(wanted))
            held = f"{len(self.sharing.holders)} of {self.slots} slots held"
            return {**self.sharing.holders[0], "slots": held + (f"; {why}" if why else "")}
        return {"who": "its own end", "pid": os.getpid(), "since": time.time()}

    def _start(self, job: Job) -> None:
        """A job to run: a run on a slot (or its check) in a thread of its own, any other on the main thread."""
        if job.sharing is None:
            self.jobs.put(job)
        else:
            threading.Thread(target=self._execute_shared, args=(job,), name=f"pool-slot-{job.kind}", daemon=True).start()

    def _watch(self, sock: socket.socket, job: Job) -> Any:
        """Until the job is done: watch the client, whose stop, end or silence stops the run.

        A stop from the client, or its end (killed), stops the run; so does its silence for lease_timeout_s (a stopped
        or hung client: its heartbeat stopped too). Returns the client's message that is neither (None if none came):
        after a check, its run may come before the check's job is done.

        It waits for the client's next message with `select`, not a timeout on the socket: the run's output goes to the
        client on this socket meanwhile (Outbox), and a send that timed out halfway (a client that reads slowly: a full
        pipe, a paused terminal) would leave half a message in the stream, and every later one unreadable."""
        sock.settimeout(None)
        heard, pending = time.monotonic(), None
        while not job.done.is_set():
            if not select.select([sock], [], [], WATCH_POLL_S)[0]:
                if time.monotonic() - heard > self.lease_timeout_s and not job.cancelled:
                    log.info(f"pool: the client (pid {(self.holder or {}).get('pid')}) said nothing for {self.lease_timeout_s:g} s: its run is stopped")
                    self._stop_job(job, STOP_SIGNAL)
                continue
            message = wire.recv(sock)  # a client sends each message whole
            heard = time.monotonic()
            if message[0] == "stop":
                self._stop_job(job, STOP_SIGNAL if message[1] == "SIGTERM" else signal.SIGINT)
            elif message[0] != "alive":
                pending = message
        return pending

    def _stop_job(self, job: Job, signum: int) -> None:
        with self.lock:
            job.cancelled = True
            if job.sharing is not None:  # a run on a slot stops at its next step (runtime/slots.py Slot.stop)
                job.stop.set()
                return
            if self.holder is not None:
                self.holder["ending"] = True
            if job.running and not job.done.is_set():
                signal.pthread_kill(self.main_thread, signum)

    # -- the main thread: runs, one at a time ---------------------------------------------------------------------
    def run_forever(self) -> None:
        while not self.stopping.is_set():
            try:
                job = self.jobs.get(timeout=1.0)
            except queue.Empty:
                self._check_idle()
                continue
            except (KeyboardInterrupt, Terminated):  # a client's stop that came after its run ended
                continue
            try:
                self._execute(job)
            except (KeyboardInterrupt, Terminated):
                pass
            finally:
                job.done.set()
        with self.free:  # stopped: runs on slots stop at their next step; the group is freed once they have
            self.free.wait_for(lambda: self.sharing is None, timeout=ENDING_WAIT_S)

    def _check_idle(self) -> None:
        if self.holder is None and self.sharing is None and time.monotonic() - self.last_used > self.idle_s:
            self.stop(f"idle for {self.idle_s / 60:g} min")
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            self.stop("the sweep that started it has ended")

    def _execute(self, job: Job) -> None:
        if job.kind == "build":  # a slot group's, for a run on a slot (its thread waits): no client context here
            try:
                job.kept["built"] = job.payload["build"]()
            except BaseException as e:
                job.kept["error"] = e
            return
        out = Outbox(job.sock)
        answer: Any = None
        try:
            with client_context(job.payload, out):
                try:
                    # Running only once a stop raises here (client_context's handlers): a stop sent before then (a
                    # client killed right after sending its run) would be ignored, and its run train to its end.
                    with self.lock:
                        if job.cancelled:
                            return
                        job.running, self.current = True, job
                    answer = ("done", self.KINDS[job.kind](self, job))
                finally:
                    self._ended(job)
        except BaseException as e:  # what the run raised; a stop that arrived as it was ending is not its answer
            if answer is None:
                answer = answer_for(e)
        out.send(answer)

    def _execute_shared(self, job: Job) -> None:
        """A run on a slot (or its check), in its own thread.

        The sharing's context entered by the first of its runs and left by the last; what this thread logs and prints
        goes to its client; a stop is its `stop` event."""
        out = Outbox(job.sock)
        answer: Any = None
        try:
            with self._shared(job, out):
                if job.cancelled:
                    raise KeyboardInterrupt
                answer = ("done", self.KINDS[job.kind](self, job))
        except BaseException as e:
            if answer is None:
                answer = answer_for(e)
        finally:
            out.send(answer)
            job.done.set()

    @contextmanager
    def _shared(self, job: Job, out: Outbox) -> Iterator[None]:
        sharing, me = job.sharing, threading.get_ident()
        with self.lock:
            if sharing.entered is None:
                stack = ExitStack()
                stack.enter_context(process_context(job.payload))
                stack.enter_context(sharing.router.installed())
                sharing.entered = stack
            underlying = sys.stdout.underlying, sys.stderr.underlying
            sharing.router.add(Forwarded(out, job.payload, underlying).route, me)
            sharing.jobs.add(job)
        try:
            yield
        finally:
            with self.lock:
                sharing.router.remove(me)
                sharing.jobs.discard(job)
                if not sharing.router:
                    sharing.entered.close()
                    sharing.entered = None

    def _ended(self, job: Job) -> None:
        with self.lock:
            job.running, self.current = False, None

    def _check(self, job: Job) -> None:
        """A run's inputs, checked as a cold run checks them before its record is written; kept for `_train`.

        The inputs: device, start checkpoint's device, model, LoRA targets, tokenized data (assemble.inputs); kept for
        its training."""
        import pickle

        from tinker_exp import assemble

        cfg, start, checked = job.payload["arguments"]
        job.kept.pop("checked", None)
        rows = pickle.loads(checked)  # as the client read and checked them (run.run): not read or tried again
        job.kept["checked"] = assemble.inputs(cfg, rows, start)

    def _train(self, job: Job) -> dict[str, Any]:
        from functools import partial

        from tinker_exp.place import GivenWorkers
        from tinker_exp.run import train_run, validate

        cfg, start, run_dir, wandb_config, job_number = job.payload["arguments"]
        given = job.kept.pop("checked", None)  # its inputs, as its check left them
        if job.sharing is None:
            self.group.worker_env = job.payload.get("worker_env", {})
            place = GivenWorkers(self.group.lend)
        else:
            place = GivenWorkers(partial(self._take_slot, job))
        with written_by_pool(run_dir, job.kept.get("pid")):  # a killed client's rerun waits for this run's end
            return train_run(cfg, validate(cfg), None, start, run_dir, wandb_config, place, job_number, given=given)

    def _take_slot(self, job: Job, cfg: Any, plan: Any, model_path: Path, run_dir: Path) -> Any:
        """A run's slot on its key's group; the run says which slot, in one line.

        The group is built first, on the main thread, when this pool keeps none: Ray's daemons live as long as the
        thread that started them."""
        with self.building:
            ready = self.group.slot_group_for(cfg, job.payload.get("worker_env", {}))
            if ready is None:
                build = Job("build", {"build": lambda: self.group.slot_group(cfg, plan, model_path, self.workers_dir(), self.slots)},
                            job.sock)  # fmt: skip
                with job.sharing.router.speaking_for(threading.get_ident(), self.main_thread):  # the build's lines are this run's
                    self.jobs.put(build)
                    while not build.done.wait(1.0):
                        if self.stopping.is_set():  # the pool ends: its run stops as on a stop
                            raise KeyboardInterrupt
                if "error" in build.kept:
                    raise build.kept["error"]
                ready = build.kept["built"]
            group, how = ready
            slot = group.fill(cfg.optimizer, cfg.trainer, plan.optimizer_values, stop=job.stop)
        job.kept["holder"]["slot"] = slot.index + 1  # `pool status` says which run holds which slot
        others = len(group.slots) - 1
        beside = f", beside {others} other run{'s' * (others != 1)}" if others else ""
        log.info(f"pool: slot {slot.index + 1} of {group.capacity} on the pool at {self.address}: {how}{beside}")
        return slot

    def workers_dir(self) -> Path:
        return wire.workers_dir_of(self.address)

    def _prepare(self, job: Job) -> str:
        from tinker_exp.runtime.inputs import model_dir
        from tinker_exp.runtime.warm import describe_key

        from tinker_exp.run import validate

        (cfg,) = job.payload["arguments"]
        self.group.worker_env = job.payload.get("worker_env", {})
        kept, _ = self.group.prepare(cfg, validate(cfg), model_dir(cfg.model), self.workers_dir())
        return describe_key(kept.key)

    def fits(self, request: dict[str, Any]) -> dict[str, Any]:
        """Whether this pool is free and keeps a group for the run in `request`, and how many groups it keeps.

        `request` holds the run's config and worker environment."""
        try:
            fits = request.get("code") == self.code and self.group.has_group_for(request["config"], request.get("worker_env", {}))
        except Exception:  # a config this pool cannot judge (a model it cannot find): the run's own checks say why
            fits = False
        return {"free": self.holder is None and not self.stopping.is_set(), "fits": fits, "groups": len(self.group.kept.groups)}

    KINDS = {"run": _train, "check": _check, "prepare": _prepare}
    """What the main thread does for each kind of job."""

    # -- status and the end -----------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        from tinker_exp.runtime.warm import rss_mb

        groups = self.group
        return {
            "pid": os.getpid(),
            "address": str(self.address),
            "since": self.started,
            "idle_s": self.idle_s,
            "idle_for_s": 0.0 if self.holder or self.sharing else time.monotonic() - self.last_used,
            "holder": self.holder,
            "slots": self.slots,
            "on_slots": [dict(holder) for holder in self.sharing.holders] if self.sharing is not None else [],
            "groups": [{**group, "memory_mb": [rss_mb(pid) for pid in group["pids"]]} for group in groups.describe()],
            "max_groups": groups.kept.max_groups,
            "memory_budget_mb": groups.kept.memory_budget_mb,
            "runs": groups.runs,
            "memory_mb": {"pool": rss_mb(os.getpid())},
        }

    def stop(self, why: str) -> None:
        if not self.stopping.is_set():
            log.info(f"pool: stopping: {why}")
        self.stopping.set()
        with self.lock:
            current = [self.current] if self.current is not None else []
            current += list(self.sharing.jobs) if self.sharing is not None else []
        for job in current:
            self._stop_job(job, STOP_SIGNAL)


def answer_for(error: BaseException) -> tuple[str, Any]:
    """What the client raises.

    Our own stops as they are (one line and their exit code there, as in a cold run); anything else as its traceback."""
    import pickle

    if isinstance(error, (*STOPS, KeyboardInterrupt)):
        try:
            pickle.dumps(error)
            return ("raised", error)
        except Exception:
            pass
    return ("crashed", "".join(traceback.format_exception(error)))


class Outbox:
    """Messages to the client, from any thread (a log record may come from W&B's or Ray's)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.lock = sock, threading.Lock()

    def send(self, message: Any) -> None:
        with self.lock:
            try:
                wire.send(self.sock, message)
            except OSError:
                pass  # the client is gone: its run is being stopped


class ForwardedStream:
    """sys.stdout / sys.stderr during a run: what is written goes to the client's."""

    def __init__(self, out: Outbox, name: str, isatty: bool, underlying: Any) -> None:
        self.out, self.name, self._isatty, self.underlying = out, name, isatty, underlying
        self.encoding = "utf-8"

    def fileno(self) -> int:
        return self.underlying.fileno()  # for a library's fault handler: this process's own (the pool's log)

    def write(self, text: str) -> int:
        if text:
            self.out.send((self.name, text))
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return self._isatty


class ForwardedRecords(logging.Handler):
    def __init__(self, out: Outbox) -> None:
        super().__init__()
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        fields = dict(record.__dict__)
        fields["msg"], fields["args"] = record.getMessage(), None
        if record.exc_info:
            fields["exc_text"] = self.formatter.formatException(record.exc_info) if self.formatter else logging.Formatter().formatException(record.exc_info)
        fields["exc_info"] = None
        self.out.send(("log", fields))


@contextmanager
def client_context(payload: dict[str, Any], out: Outbox) -> Iterator[None]:
    """The context of one run: the client's environment, working dir and log level; its output and signals.

    For one run: the client's environment and working dir, its log level; what the run logs and prints goes to the
    client; SIGINT and the stop signal raise in this thread as Ctrl-C and SIGTERM do in a cold run."""
    root = logging.getLogger()
    handlers, streams = list(root.handlers), (sys.stdout, sys.stderr)
    forwarded = Forwarded(out, payload, streams)
    root.handlers = [forwarded.records]
    sys.stdout, sys.stderr = forwarded.stdout, forwarded.stderr

    def terminated(signum: int, frame: Any) -> None:
        if SIGTERM_RECEIVED.is_set():
            return
        SIGTERM_RECEIVED.set()
        raise Terminated()

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, STOP_SIGNAL)}
    try:
        with process_context(payload), sigterm_raises():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(STOP_SIGNAL, terminated)
            yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.stdout, sys.stderr = streams
        root.handlers = handlers


@contextmanager
def process_context(payload: dict[str, Any]) -> Iterator[None]:
    """What a client's run sets process-wide here: its environment, working dir, sys.path and log level.

    Its own modules forgotten and warnings shown again after (as in a fresh process)."""
    environ, cwd, path = dict(os.environ), os.getcwd(), list(sys.path)
    modules = set(sys.modules)
    root = logging.getLogger()
    level = root.level
    os.environ.clear()
    os.environ.update({k: v for k, v in environ.items() if k.startswith("RAY_")})  # this process's Ray session
    os.environ.update(payload.get("environ", {}))
    os.chdir(payload.get("cwd", cwd))
    sys.path[:] = payload.get("sys_path", path)  # user code (env.reward) imported as the client would import it
    importlib.invalidate_caches()  # a file made since the last run is found
    root.setLevel(payload.get("log_level", logging.INFO))
    reset_warning_registries()  # a warning shown to an earlier run is shown again, as in a fresh process
    try:
        yield
    finally:
        root.setLevel(level)
        forget_user_modules(set(sys.modules) - modules)
        sys.path[:] = path
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)


class Forwarded:
    """One client's run's output: its stdout, stderr and log records, sent to the client."""

    def __init__(self, out: Outbox, payload: dict[str, Any], underlying: tuple[Any, Any]) -> None:
        self.stdout = ForwardedStream(out, "stdout", False, underlying[0])
        self.stderr = ForwardedStream(out, "stderr", payload.get("isatty", False), underlying[1])
        self.records = ForwardedRecords(out)
        self.route = threads.Route(self.stdout, self.stderr, self.records)
        """The same, as a run's route where runs share this process (runs on slots: `threads.Router`)."""


def forget_user_modules(names: set[str]) -> None:
    """The run's own modules (its reward, what that imports from the user's folders) forgotten once it ends.

    The next run imports them again as they are then. What the run imported of tinker_exp, hydra_plugins or the
    installed packages stays imported (the pool's point), as does a module without a file."""
    for name in names:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file and is_user_file(Path(file)):
            del sys.modules[name]


def is_user_file(file: Path) -> bool:
    """A module file neither of this checkout's packages nor of the interpreter's (stdlib, site-packages)."""
    import site
    import sysconfig

    installed = {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages(), *sysconfig.get_paths().values()}
    ours = {str(Path(__file__).resolve().parents[2] / package) for package in wire.PACKAGES}
    resolved = file.resolve()
    return not any(resolved.is_relative_to(folder) for folder in installed | ours if folder)


def reset_warning_registries() -> None:
    for module in list(sys.modules.values()):
        registry = getattr(module, "__dict__", {}).get("__warningregistry__")  # no getattr: lazy modules import on it
        if isinstance(registry, dict):
            registry.clear()


def serve(address: Path, idle_s: float, parent_pid: int | None, max_groups: int | None = None, memory_mb: float | None = None,
          slots: int = 1) -> None:  # fmt: skip
    """The pool's process, until it is asked down, idles out or (a sweep's) its sweep ends.

    One process an address: it holds the address's lock file (flock) from its start to its end, and names itself there
    (`down` finds a pool that does not listen yet by it)."""
    import faulthandler

    from tinker_exp.errors import one_line_warning

    stops: list[str] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stops.append("SIGTERM"))  # a `down` while it starts: kept
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", stream=sys.stderr)
    faulthandler.enable(sys.stderr)  # a crash in native code: its traceback in pool.log
    lock = wire.hold_address(address)
    if lock is None:
        log.info(f"pool: another pool process holds {address}; this one (pid {os.getpid()}) ends")
        sys.exit(wire.ALREADY_EXIT)
    warnings.formatwarning = one_line_warning
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a client's stop is for its run only: see Host._stop_job
    signal.signal(STOP_SIGNAL, signal.SIG_IGN)
    warm_imports()
    host = Host(address, idle_s, parent_pid, max_groups, memory_mb, slots)
    signal.signal(signal.SIGTERM, lambda signum, frame: host.stop("SIGTERM"))
    if stops:
        host.stop(f"{stops[0]} while it started")
    server = host.listen()
    at_once = f"; {slots} LoRA SFT runs at once, each on a slot" if slots > 1 else ""
    log.info(f"pool: listening at {address} (pid {os.getpid()}, idles out after {idle_s / 60:g} min{at_once})")
    try:
        host.run_forever()
    except BaseException as e:
        log.error(f"pool: ended by an error: {''.join(traceback.format_exception(e)).rstrip()}")
        raise
    finally:
        server.close()
        if address.exists():
            address.unlink()
        end_wandb_service()  # before its children are ended: W&B's service is one of them
        descendants = descendant_pids(os.getpid())
        host.group.close()
        ended_all(descendants)  # Ray's agents end with the pool, not minutes later
        log.info("pool: down")
        lock.close()


def descendant_pids(pid: int) -> list[int]:
    """Every process below `pid` (Linux's /proc; [] elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def ended_all(pids: list[int], grace_s: float = 5.0) -> None:
    """Those of `pids` still running after `grace_s` (Ray's own shutdown had them end) are killed."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(wire.alive(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        if wire.alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def warm_imports() -> None:
    """What every run imports, imported before the first: the pool's point is that no run waits for it."""
    from tinker_exp.runtime import rl_workers, sampler, workers  # noqa: F401
    from tinker_exp.runtime.workers import _worker_class
    from tinker_exp.sweep.report import warm_up
    from tinker_exp.train import loop, sinks  # noqa: F401

    _worker_class()
    rl_workers._rl_worker_class()
    warm_up()  # every run draws its report.png
