"""Where a run trains: the one seam a run asks for its workers. A cold group it starts for itself (the default), the
user's warm pool (found per backend.pool), or workers another part starts for it: a pool's group lent to the run in
the pool's process, a benchmark's wrapped group, a test's fakes (later: a slot of a packed group).

The entry points (the CLI, the pool's process, the sweeps, the server) hand a run a place, or let `where_to_train`
find one from the config; they do not import each other. Pure Python: torch, verl and ray are imported by the cold
group's start (tinker_exp/assemble.py), the pool's client speaks to the pool over a socket.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from tinker_exp.config import Config
from tinker_exp.train.protocols import Workers

if TYPE_CHECKING:
    from tinker_exp.optim import Plan

log = logging.getLogger(__name__)

StartWorkers = Callable[[Config, "Plan", Path, Path], Workers]
"""(config, plan, model dir, run dir) -> the worker group, starting (its `ready()` waits for it)."""


class Place(Protocol):
    """Where a run trains, held for it from before its record is written until it ends."""

    train_run: Callable[..., dict[str, Any]] | None
    """A place that trains the run in its own process (a warm pool): the run's `train_run`, called here and run
    there; None: this process trains it, on `start_workers`'s group. Such a place also checks the run's inputs
    there before its record is written (`check(cfg, rows, start)`: a refusal raises), and keeps them for the run."""

    def describe(self) -> str:
        """The one line the run says about where it trains, as it starts training ("" says nothing)."""
        ...

    def start_workers(self, cfg: Config, plan: Plan, model_path: Path, run_dir: Path, choice: Any) -> Workers:
        """The run's worker group, starting. `choice`: the resolved device (runtime.device.DeviceChoice)."""
        ...

    def release(self) -> None:
        """The run has ended: the place is free for another."""
        ...


@dataclass(frozen=True)
class ColdGroup:
    """verl's workers on Ray, started by this run for itself and freed at its end."""

    why: str = ""
    """Why the run starts cold when it could have taken a pool (its one line); "" says nothing."""
    train_run = None

    def describe(self) -> str:
        return self.why

    def start_workers(self, cfg: Config, plan: Plan, model_path: Path, run_dir: Path, choice: Any) -> Workers:
        from tinker_exp.assemble import verl_workers

        return verl_workers(cfg, plan, model_path, run_dir, choice)

    def release(self) -> None:
        pass


@dataclass(frozen=True)
class GivenWorkers:
    """Workers another part starts for the run, in this process: a warm pool's group lent to it, or a slot of one
    (pool/host.py), a benchmark's wrapped verl group, a test's fakes."""

    start: StartWorkers
    why: str = ""
    """The run's one line about them; "" says nothing."""
    workers_log: Path | None = None
    """Where the workers print, when not the run dir's (a slot's group: every slot's run shares them)."""
    train_run = None

    def describe(self) -> str:
        return self.why

    def start_workers(self, cfg: Config, plan: Plan, model_path: Path, run_dir: Path, choice: Any) -> Workers:
        return self.start(cfg, plan, model_path, run_dir)

    def release(self) -> None:
        pass


@dataclass(frozen=True)
class OnSlot:
    """A slot of a group this process keeps (runtime/warm.py `SlotGroups`): a sweep's LoRA trials, K at once on one
    loaded base model, each trial's run in its own thread. The run says which slot it took as its workers start."""

    groups: Any
    """The process's `SlotGroups`."""
    stop: Any
    """A threading.Event: set, the trial is cancelled (its next step raises KeyboardInterrupt)."""
    workers_log: Path
    """Where the group's workers print (every slot's trial shares them)."""
    train_run = None

    def describe(self) -> str:
        return ""

    def start_workers(self, cfg: Config, plan: Plan, model_path: Path, run_dir: Path, choice: Any) -> Workers:
        slot, line = self.groups.take(cfg, plan, model_path, choice, self.stop)
        log.info(line)
        return slot

    def release(self) -> None:
        pass


def where_to_train(cfg: Config) -> Place:
    """The place the config asks for (backend.pool: none, auto or an address), held for the run: the user's pool, or
    a cold group (a run over several nodes starts its own). A busy or untrusted pool is refused in one line by
    pool/client.py's `attach`, before the run writes anything."""
    if cfg.backend.nodes > 1:
        return ColdGroup()
    from tinker_exp.pool.client import attach

    found = attach(cfg)
    return found if found.train_run is not None else ColdGroup(found.describe())


def on_a_pool_slot(cfg: Config) -> Place | None:
    """A slot of the user's warm pool for a sweep's trial on slots (backend.pool as a run reads it), held, when the
    pool takes it on a slot: beside the sweep's other trials there (it waits for a free slot while they hold them
    all); else None (the sweep's own group). A pool's address that refuses the trial raises, as for a run."""
    from tinker_exp.pool.client import attach

    found = attach(cfg, wait_for_slot=True)
    if found.train_run is None or not found.info.get("slot"):
        found.release()
        return None
    return found
