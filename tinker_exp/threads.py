"""Where a thread's output goes: the threads a run starts count as its own, and one router sends each run's lines to it.

Where runs share one process (a pool's runs on slots: pool/host.py; a sweep's trials as threads:
hydra_plugins/tinker_exp_plugins/slot_jobs.py), a line goes where the run of the thread that made it goes, found by
that thread's id. A thread started here counts as the thread that started it (`owner`), so its lines (W&B's run
line, a reward's prints, a warning) reach its run's log and terminal, not the shared process's.
"""

from __future__ import annotations

import logging
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, TextIO

RUN_LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
"""A run dir's log records, as conf/hydra/job_logging writes them."""

_owners: dict[int, int] = {}
"""A thread started by `start`, while it runs -> the thread it works for (never itself one started here)."""


def owner(ident: int | None = None) -> int:
    """The thread that thread `ident` (the calling thread by default) works for.

    The one that started it with `start` (or started its starter), else itself. Output routers look lines up by this
    id."""
    ident = threading.get_ident() if ident is None else ident
    return _owners.get(ident, ident)


def start(target: Callable[[], Any], name: str) -> threading.Thread:
    """`target()` in a new daemon thread that works for the calling thread (`owner`); started, and returned."""
    parent = owner()

    def run() -> None:
        me = threading.get_ident()
        _owners[me] = parent
        try:
            target()
        finally:
            del _owners[me]  # a later thread may get this id

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


class Route(NamedTuple):
    """Where one run's output goes: what its threads print (stdout, stderr) and their log records."""

    stdout: TextIO
    stderr: TextIO
    records: logging.Handler


def run_log(path: Path) -> logging.Handler:
    """A handler of log records into a run dir's log file (`RUN_LOG_FORMAT`), opened at its first record."""
    handler = logging.FileHandler(path, delay=True)
    handler.setFormatter(logging.Formatter(RUN_LOG_FORMAT))
    return handler


class Router:
    """The process's one router of output by thread (`owner`).

    A routed thread's prints and log records go to its run's `Route`, every other thread's where they went. Used
    wherever runs share a process: a pool's runs on slots (pool/host.py), a sweep's trials as threads
    (hydra_plugins/tinker_exp_plugins/slot_jobs.py)."""

    def __init__(self) -> None:
        self.routes: dict[int, Route] = {}
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.routes)

    def route(self, ident: int | None = None) -> Route | None:
        """The route of thread `ident` (the calling thread by default), or of the thread it works for; None: unrouted."""
        return self.routes.get(owner(ident))

    def add(self, route: Route, thread: int | None = None) -> None:
        """Thread `thread`'s output (the calling thread's by default) goes to `route` from now on."""
        with self.lock:
            self.routes[threading.get_ident() if thread is None else thread] = route

    def remove(self, thread: int | None = None) -> Route | None:
        """Thread `thread` (the calling one by default) unrouted; its route returned (its files are the caller's)."""
        with self.lock:
            return self.routes.pop(threading.get_ident() if thread is None else thread, None)

    @contextmanager
    def speaking_for(self, thread: int, speaker: int | None = None) -> Iterator[None]:
        """Within: `speaker`'s output (the calling thread's by default) goes where `thread`'s goes.

        E.g. a group built on another thread for that run."""
        speaker = threading.get_ident() if speaker is None else speaker
        with self.lock:
            if thread in self.routes:
                self.routes[speaker] = self.routes[thread]
        try:
            yield
        finally:
            self.remove(speaker)

    @contextmanager
    def installed(self, loggers: tuple[str, ...] = ("tinker_exp",)) -> Iterator[None]:
        """Within: sys.stdout and sys.stderr route by thread, and so do log records.

        The handlers of the root logger and of `loggers` leave a routed thread's records out, and one more on the root
        logger hands those to their route."""
        handlers = [*logging.getLogger().handlers, *(h for name in loggers for h in logging.getLogger(name).handlers)]
        unrouted, routed = NotRouted(self), RoutedRecords(self)
        for handler in handlers:
            handler.addFilter(unrouted)
        logging.getLogger().addHandler(routed)
        streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = RoutedStream(self, "stdout", streams[0]), RoutedStream(self, "stderr", streams[1])
        try:
            yield
        finally:
            sys.stdout, sys.stderr = streams
            logging.getLogger().removeHandler(routed)
            for handler in handlers:
                handler.removeFilter(unrouted)


class RoutedStream:
    """sys.stdout or sys.stderr while a `Router` is installed.

    A routed thread's text to its route, any other's to the stream it replaced."""

    def __init__(self, router: Router, name: str, underlying: TextIO) -> None:
        self.router, self.name, self.underlying = router, name, underlying

    def _target(self) -> TextIO:
        route = self.router.route()
        return self.underlying if route is None else getattr(route, self.name)

    def write(self, text: str) -> int:
        target = self._target()
        target.write(text)
        if target is not self.underlying:
            target.flush()  # a run's log file is read while it runs
        return len(text)

    def flush(self) -> None:
        self._target().flush()

    def isatty(self) -> bool:
        return self._target().isatty()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.underlying, name)


class RoutedRecords(logging.Handler):
    """On the root logger while a `Router` is installed: a routed thread's record to its route's handler."""

    def __init__(self, router: Router) -> None:
        super().__init__()
        self.router = router

    def emit(self, record: logging.LogRecord) -> None:
        route = self.router.route(record.thread or 0)
        if route is not None:
            route.records.handle(record)


class NotRouted(logging.Filter):
    """On the process's own handlers while a `Router` is installed: a routed thread's records are not theirs."""

    def __init__(self, router: Router) -> None:
        super().__init__()
        self.router = router

    def filter(self, record: logging.LogRecord) -> bool:
        return self.router.route(record.thread or 0) is None
