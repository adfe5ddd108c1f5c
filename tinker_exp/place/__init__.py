"""Where a run trains: the one seam a run asks for its workers, and the one `choose` that decides it.

A run holds its place from before its record is written until it ends, then releases it. There are two kinds:
- a `Place`: this process trains the run on the place's workers (`this_process.py`: a cold group the run starts, the
  default; workers another part starts, a warm pool's group in the pool's process, a benchmark's, a test's fakes; a
  slot of the sweep's own packed group);
- a `Lease` (`lease.py`): the user's or a sweep's warm pool trains the run in the pool's process, whole or on a slot of
  its packed group; the run's side only sends it the run and shows what it says (`wire.py`: the socket; `pools.py`:
  pool processes started on this machine, a sweep's own pools).
The entry points (the CLI, the pool's process, the sweeps, the server) hand a run a place, or let `choose` find one;
they do not import each other. Pure Python: torch, verl and ray are imported by the cold group's start
(tinker_exp/assemble.py); a pool is spoken to over a socket.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tinker_exp.config import Config
from tinker_exp.place.this_process import ColdGroup, GivenWorkers, StartWorkers, SweepSlot
from tinker_exp.train.protocols import Workers

if TYPE_CHECKING:
    from tinker_exp.optim import Plan
    from tinker_exp.place.lease import Lease


class Place(Protocol):
    """Where this process trains a run.

    It gives the run its workers (`start_workers`, once) and one line about them (`describe`); the run releases it when
    it ends, however it ends (`release`). A place does not free the workers it gives: the run does (a cold group), or
    whoever lent them (a pool, the sweep's own group)."""

    workers_log: Path | None
    """Where the workers print, when not the run dir's workers.log (a packed group's: its slots' runs share them)."""

    def describe(self) -> str:
        """The one line the run says about where it trains, as it starts training ("" says nothing)."""
        ...

    def start_workers(self, cfg: Config, plan: Plan, model_path: Path, run_dir: Path, choice: Any) -> Workers:
        """The run's worker group, starting. `choice`: the resolved device (runtime.device.DeviceChoice)."""
        ...

    def release(self) -> None:
        """The run has ended: the place is free for another."""
        ...


def choose(cfg: Config, sweep_slot: SweepSlot | None = None) -> Place | Lease:
    """Where a run with this config trains, held for it; every such decision is made here.

    `sweep_slot`: the slot of its own packed group that a sweep's trial on slots takes when no pool's slot takes it.
    - several nodes: a cold group (the run starts a Ray cluster over its allocation);
    - a pool named by backend.pool, or found (auto: a free pool of the sweep's, else the user's): a lease, of the whole
      group or (a LoRA SFT run) of a slot beside the pool's other runs on slots; a trial of a sweep on slots waits for
      a pool's slot and never leases a pool whole. A named pool that cannot take the run is refused in one line
      (lease.py `lease_a_pool`), before the run writes anything;
    - else the sweep's own slot, or a cold group with the one line why no pool took it."""
    if cfg.backend.nodes > 1:
        return ColdGroup()
    from tinker_exp.place.lease import Lease, lease_a_pool

    found = lease_a_pool(cfg, wait_for_slot=sweep_slot is not None)
    if isinstance(found, Lease) and (sweep_slot is None or found.info.get("slot")):
        return found
    if isinstance(found, Lease):  # the pool would lend its group whole: a trial on slots takes the sweep's own slot
        found.release()
    return sweep_slot if sweep_slot is not None else found


__all__ = ["ColdGroup", "GivenWorkers", "Place", "StartWorkers", "SweepSlot", "choose"]
