"""SIGTERM as an exception in the main thread, from the moment a job starts; Slurm's warning signals kept from Ray.

Slurm may stop a job while it is starting; its warning signals are kept from Ray's processes."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from tinker_exp.errors import Terminated

SIGTERM_RECEIVED = threading.Event()
"""Set once SIGTERM arrived: an error raised afterwards (inside ray.get, say) is part of the stop."""
RAISING: list = []
"""The `sigterm_raises` blocks the main thread is in (their handlers): a run's stop flag counts only inside one (an
in-process run after another's SIGTERM, in a test process, is not stopped by it)."""

STOPPING_WAIT_S = 2.0
"""Once SIGTERM arrived, the longest a clean-up waits on another process (Ray freeing the workers, a Ray node
draining): Slurm signals every process of the job at once (Ray's daemons, W&B's service) and SIGKILLs what is left
after its KillWait (30 s by default); with 10 s waits, a cancelled 2-node job's driver was SIGKILLed on a loaded
machine before it exited."""


def cleanup_wait(seconds: float) -> float:
    """How long a clean-up may wait on another process: `seconds`, or at most STOPPING_WAIT_S once SIGTERM arrived."""
    return min(seconds, STOPPING_WAIT_S) if SIGTERM_RECEIVED.is_set() else seconds


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within: SIGTERM raises Terminated in the main thread (replacing submitit's handler, which ignores it)."""

    def handler(signum: int, frame: Any) -> None:
        if SIGTERM_RECEIVED.is_set():
            return  # already stopping: a second SIGTERM must not cut the clean-up short
        SIGTERM_RECEIVED.set()
        raise Terminated()

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    SIGTERM_RECEIVED.clear()
    previous = signal.signal(signal.SIGTERM, handler)
    RAISING.append(handler)
    try:
        yield
    finally:
        RAISING.remove(handler)
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """Within (the CLI's main thread): SIGTERM does what Ctrl-C would do at that moment, once.

    SIGINT's handler then: a sweep notes Ctrl-C, or defers it around what must not be cut. It sets SIGTERM_RECEIVED: the
    process then ends 143, not 130. A run's own `sigterm_raises` replaces it while the run trains; a sweep's process has
    none, and would otherwise end at once, its trials in threads on slots with it (their run dirs' locks left, W&B runs
    not finished). Ray's driver, started later in a thread, puts none of its own over it (runtime/ray_cluster.py
    `start_ray`). Where Ctrl-C is ignored (a job started in the background), SIGTERM still raises KeyboardInterrupt."""

    def handler(signum: int, frame: Any) -> None:
        if SIGTERM_RECEIVED.is_set():
            return  # already stopping: a second SIGTERM must not cut the clean-up short
        SIGTERM_RECEIVED.set()
        ctrl_c = signal.getsignal(signal.SIGINT)
        if callable(ctrl_c):
            ctrl_c(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def sigterm_deferred() -> Iterator[None]:
    """Within: a SIGTERM waits until the block is done, then acts as it would have.

    So what the block writes is written whole (a row reaches every sink or none: the last row of a stopped run is in
    metrics.jsonl and W&B)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[Any] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: arrived.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if arrived and callable(previous):
            previous(signal.SIGTERM, arrived[0])
        elif arrived and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGTERM)


@contextmanager
def sigterm_handler_kept() -> Iterator[None]:
    """Within: whatever a library installs for SIGTERM (ray.init installs a sys.exit) is put back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if ours is not None:
            signal.signal(signal.SIGTERM, ours)


SIGNALS_FOR_THE_DRIVER = (signal.SIGUSR1, signal.SIGUSR2)
"""Slurm's warning signals (`--signal`, submitit's time-limit USR2): meant for the driver, whose handler requeues
the job. Slurm delivers them to every process of the job step, and SIGUSR2's default action ends a process."""


@contextmanager
def ignored_by_children(signums: tuple[int, ...] = SIGNALS_FOR_THE_DRIVER) -> Iterator[None]:
    """Within: these signals are ignored, so processes started meanwhile inherit SIG_IGN.

    Those processes (Ray's GCS, raylet and, through them, its workers) outlive the signals; the driver's handlers are
    put back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def stop_if_terminated() -> None:
    """Raise Terminated in the main thread once SIGTERM has arrived, at a step's start.

    For a SIGTERM whose exception was lost on its way (raised by the handler inside a library's own call that caught
    it). The handler ignores every later SIGTERM (a second one must not cut the clean-up short), so without this such a
    run would train on to its end and exit 0. Other threads (a pool's runs on slots) never stop so: the flag is the main
    thread's run's."""
    if SIGTERM_RECEIVED.is_set() and RAISING and threading.current_thread() is threading.main_thread():
        raise Terminated()


def as_stop(error: BaseException) -> BaseException:
    """An error raised after SIGTERM arrived (Ray hands it back as SystemExit(1), say) is the stop itself."""
    if SIGTERM_RECEIVED.is_set() and not isinstance(error, Terminated):
        return Terminated()
    return error
