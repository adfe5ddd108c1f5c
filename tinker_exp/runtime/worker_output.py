"""What the workers print (verl's start-up warnings, per-rank checkpoint lines, ...) goes to a file in the run dir.

Ray forwards every worker's stdout and stderr to the driver (``log_to_driver``) through one dispatcher, whose
default handler prints them to the terminal. Within ``worker_output_to`` a handler of ours writes every line,
complete and with Ray's ``(actor pid=..., ip=...)`` prefix, to the file; the terminal gets them too only when
asked (``verbose=true``). The worker group starts it once Ray is connected. Ray's dispatcher is internal API: if it moves, output stays on the terminal, as before.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
RAY_PRINTER = "ray_print_logs"  # the name Ray gives its own handler
RAY_OWN = ("autoscaler",)
"""The `pid` Ray gives batches of its own monitor's output (the cluster's status, repeated while it idles): kept out
of workers.log (with verbose=true Ray's own handler still prints them)."""


def _prefix(batch: dict[str, Any]) -> str:
    who = batch.get("actor_name") or batch.get("task_name") or ""
    return f"({who} pid={batch.get('pid')}, ip={batch.get('ip')}) ".replace("( ", "(")


_ORIGINAL_HANDLERS: list | None = None  # the dispatcher's handlers before we first touched it
_CURRENT: "WorkerOutput | None" = None


class WorkerOutput:
    """From start() (Ray connected) on, worker output goes to `path` (and the terminal, if `echo`).

    Lines arrive asynchronously, after the call that caused them: the last checkpoint's lines come in after the
    run ended. So the file stays the destination until the next WorkerOutput of this process starts (or the
    process ends); stop() only flushes.
    """

    def __init__(self, path: Path, echo: bool = False):
        self.path, self.echo = path, echo
        self._file: Any = None
        self._lock = threading.Lock()

    def start(self) -> None:
        global _ORIGINAL_HANDLERS, _CURRENT
        try:
            from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
        except ImportError:  # pragma: no cover - a Ray without this dispatcher
            log.warning("worker output stays on the terminal: Ray's log dispatcher was not found")
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        with dispatcher._lock:
            if _ORIGINAL_HANDLERS is None:
                _ORIGINAL_HANDLERS = list(dispatcher.handlers)
            kept = [pair for pair in _ORIGINAL_HANDLERS if self.echo or pair[0] != RAY_PRINTER]
            dispatcher.handlers = [*kept, ("tinker_exp_worker_output", self._write)]
            previous, _CURRENT = _CURRENT, self
        if previous is not None:
            previous.close()

    def _write(self, batch: dict[str, Any]) -> None:
        if batch.get("pid") in RAY_OWN:  # Ray's autoscaler status, every few seconds while idle: not the workers'
            return
        prefix = _prefix(batch)
        with self._lock:
            if self._file is not None:
                self._file.writelines(prefix + line + "\n" for line in batch.get("lines", []))
                self._file.flush()

    def stop(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
