"""Places where this process trains the run: a cold group it starts, workers another part starts for it, a slot.

The slot is one of the sweep's own packed group. The `Place` contract they keep is written once, in
tinker_exp/place/__init__.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tinker_exp.config import Config
from tinker_exp.train.protocols import Workers

if TYPE_CHECKING:
    from tinker_exp.optim import Plan

log = logging.getLogger(__name__)

StartWorkers = Callable[[Config, "Plan", Path, Path], Workers]
"""(config, plan, model dir, run dir) -> the worker group, starting (its `ready()` waits for it)."""


@dataclass(frozen=True)
class ColdGroup:
    """verl's workers on Ray, started by this run for itself and freed at its end."""

    why: str = ""
    """Why the run starts cold when it could have taken a pool (its one line); "" says nothing."""
    workers_log = None

    def describe(self) -> str:
        return self.why

    def start_workers(self, cfg: Config, plan: Plan, model_path: Path, run_dir: Path, choice: Any) -> Workers:
        from tinker_exp.assemble import verl_workers

        return verl_workers(cfg, plan, model_path, run_dir, choice)

    def release(self) -> None:
        pass


@dataclass(frozen=True)
class GivenWorkers:
    """Workers another part starts for the run, in this process.

    A warm pool's group lent to it, or a slot of one (pool/host.py), a benchmark's wrapped verl group, a test's
    fakes."""

    start: StartWorkers
    why: str = ""
    """The run's one line about them; "" says nothing."""
    workers_log: Path | None = None
    """Where the workers print, when not the run dir's (a slot's group: every slot's run shares them)."""

    def describe(self) -> str:
        return self.why

    def start_workers(self, cfg: Config, plan: Plan, model_path: Path, run_dir: Path, choice: Any) -> Workers:
        return self.start(cfg, plan, model_path, run_dir)

    def release(self) -> None:
        pass


@dataclass(frozen=True)
class SweepSlot:
    """A slot of a packed group the sweep's own process keeps (runtime/warm.py `SlotGroups`).

    A sweep's LoRA trials, K at once on one loaded base model, each trial's run in its own thread. The run says which
    slot it took as its workers start."""

    groups: Any
    """The sweep process's `SlotGroups`."""
    stop: Any
    """A threading.Event: set, the trial is cancelled (its next step raises KeyboardInterrupt)."""
    workers_log: Path
    """Where the group's workers print (every slot's trial shares them)."""

    def describe(self) -> str:
        return ""

    def start_workers(self, cfg: Config, plan: Plan, model_path: Path, run_dir: Path, choice: Any) -> Workers:
        slot, line = self.groups.take(cfg, plan, model_path, choice, self.stop)
        log.info(line)
        return slot

    def release(self) -> None:
        pass
