"""Threads a run starts for its own work (its W&B start-up, its RL sampler): what they log or print is the run's.

Where runs share one process (a pool's runs on slots: pool/host.py; a sweep's trials as threads:
hydra_plugins/tinker_exp_plugins/slot_jobs.py), a line goes where the run of the thread that made it goes, found by
that thread's id. A thread started here counts as the thread that started it (`owner`), so its lines (W&B's run
line, a reward's prints, a warning) reach its run's log and terminal, not the shared process's.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

_owners: dict[int, int] = {}
"""A thread started by `start`, while it runs -> the thread it works for (never itself one started here)."""


def owner(ident: int | None = None) -> int:
    """The thread that thread `ident` (the calling thread by default) works for: the one that started it with
    `start` (or started its starter), else itself. Output routers look lines up by this id."""
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
