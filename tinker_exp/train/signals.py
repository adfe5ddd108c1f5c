"""SIGTERM as an exception in the main thread, from the moment a job starts (Slurm may stop it while starting)."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from tinker_exp.errors import Terminated

SIGTERM_RECEIVED = threading.Event()
"""Set once SIGTERM arrived: an error raised afterwards (inside ray.get, say) is part of the stop."""


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
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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


def as_stop(error: BaseException) -> BaseException:
    """An error raised after SIGTERM arrived (Ray hands it back as SystemExit(1), say) is the stop itself."""
    if SIGTERM_RECEIVED.is_set() and not isinstance(error, Terminated):
        return Terminated()
    return error
