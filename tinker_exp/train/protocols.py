"""The seams of the training layer: what the loop needs from the workers and what it hands to sinks.

The real ``Workers`` is ``tinker_exp.runtime.workers.TinkerWorkers`` (verl on Ray); tests stand in a fake to
check the loop's bookkeeping without a Ray cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence


@dataclass
class StepResult:
    """What one Tinker step (forward_backward -> optimizer_step) reports back."""

    loss: float
    grad_norm: float
    applied: list[list[dict[str, Any]]]
    """The override keys every param group holds after the step: per rank, per param group."""


class Workers(Protocol):
    """A group of training workers with one model and optimizer over all ranks."""

    def ready(self) -> None:
        """Wait until the group, started by its constructor, can train (the driver works meanwhile)."""
        ...

    def train_step(self, examples: Sequence[Any], optim_step_params: dict[str, Any] | None) -> StepResult: ...

    def evaluate(self, examples: Sequence[Any]) -> float:
        """Forward only, nothing about training changes: the batch's mean NLL per loss token."""
        ...

    def save_checkpoint(self, folder: Path, step: int) -> None: ...

    def export_adapter(self, folder: Path) -> int:
        """LoRA only: the trained adapter in peft's format into `folder`; returns its number of parameters."""
        ...

    def load_checkpoint(self, folder: Path) -> None: ...

    def shutdown(self) -> None: ...


class Sink(Protocol):
    """Where each step's metrics row goes (metrics.jsonl, W&B, a progress bar)."""

    def log(self, row: dict[str, Any]) -> None: ...

    def close(self, exit_code: int = 0) -> None: ...


class Watcher(Protocol):
    """Sees each evaluation's row and may stop the run there (a study's trial whose pruner says so)."""

    def seen(self, steps_done: int, row: dict[str, Any]) -> bool: ...

    def stop_line(self, steps_done: int) -> str: ...


class Boundaries(Protocol):
    """A population's member: after the evaluation at each of its boundaries (and the checkpoint saved there) it
    decides, and says which plan applies from there and whose checkpoint the workers load (tinker_exp.sweep.pbt)."""

    def due(self, steps_done: int) -> bool: ...

    def boundary(self, steps_done: int, row: dict[str, Any], checkpoint: Path) -> Any:
        """A Turn: .plan, .checkpoint (None: keep the workers' state), .nonfinite_steps (None: keep the count)."""
        ...
