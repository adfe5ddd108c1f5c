"""The seams of the training layer: what the loop needs from the workers and its batch source, and gives sinks.

What acts at an evaluation: train/judges.py.

The real ``Workers`` is ``tinker_exp.runtime.workers.TinkerWorkers`` (verl on Ray); tests stand in a fake to
check the loop's bookkeeping without a Ray cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence


@dataclass
class StepResult:
    """What one Tinker step (forward_backward -> optimizer_step) reports back."""

    loss: float
    grad_norm: float
    applied: list[list[dict[str, Any]]]
    """The override keys every param group holds after the step: per rank, per param group."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """What else the step measured (an RL loss's own metrics, the calls' times): it joins the step's row."""


class Workers(Protocol):
    """A group of training workers with one model and optimizer over all ranks."""

    def ready(self) -> None:
        """Wait until the group, started by its constructor, can train (the driver works meanwhile)."""
        ...

    def train_step(self, examples: Sequence[Any], optim_step_params: dict[str, Any] | None) -> StepResult: ...

    def evaluate(self, examples: Sequence[Any]) -> float:
        """Forward only, nothing about training changes: the batch's mean NLL per loss token."""
        ...

    def evaluate_batches(self, batches: Sequence[Sequence[Any]]) -> list[float]:
        """`evaluate` of each batch, in one call.

        A slot's whole evaluation is one cycle of its group (runtime/slots.py), not a cycle a batch."""
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


class TableSink(Sink, Protocol):
    """A run's sinks together (train/sinks.py `Sinks`): the rows, and tables for the sinks that keep them (W&B)."""

    def attach_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None: ...


@dataclass(frozen=True)
class Batch:
    """What a batch source hands the loop for one step."""

    examples: Sequence[Any]
    measured: dict[str, Any] = field(default_factory=dict)
    """Values the source measured making the batch (an RL sampler's rewards, its time): they join the step's row."""


class BatchSource(Protocol):
    """Where each step's batch comes from (the data file: train/data.py `DataFileBatches`; an RL sampler next).

    Asked by step number, from the run's first step on (a resumed or branched run from its checkpoint's step): a source
    whose batch is a function of the step needs no state."""

    def batch(self, step: int) -> Batch: ...

    def state(self) -> dict[str, Any]:
        """What every checkpoint's loop.json records of the source (key `batch_source`, left out when empty)."""
        ...

    def restore(self, state: Mapping[str, Any]) -> None:
        """Before the first step of a resumed or branched run: what `state` gave at its checkpoint ({} at step 0)."""
        ...

    def close(self) -> None:
        """However the run ends: stop what the source runs beside the loop (an off-policy RL run's sampling thread)."""
        ...
