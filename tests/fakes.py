"""A stand-in for verl's worker group, for tests of bookkeeping (the loop's rows, resume, non-finite policy).

Never instead of the real test of a behaviour: each behaviour also has one real run on Ray (test_train_e2e,
test_resume). The fake follows the ``Workers`` protocol and verl's visible behaviour: an override is applied to
every param group before the step, unsent keys keep their values, and a checkpoint restores the whole state.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

from tinker_exp.train.protocols import StepResult


def builtin_params(params: dict[str, Any] | None) -> None:
    """What verl's check cannot see: a numpy float64 passes as a float once, then the param group holds a float64
    and every later plain-float override is rejected. So only builtin floats, and tuples of them, may be sent."""
    for key, value in (params or {}).items():
        items = value if type(value) is tuple else (value,)
        if type(value) not in (float, tuple) or any(type(item) is not float for item in items):
            raise TypeError(f"{key}={value!r} ({type(value).__name__}) sent: only builtin float and tuple reach verl")


class FakeWorkers:
    """`ranks` ranks of `groups` param groups. The "model" is one number that each step moves by lr (so the
    loss depends on every value sent); `nonfinite_at` steps report a NaN grad norm and skip the update."""

    def __init__(
        self,
        optimizer_values: dict[str, Any],
        ranks: int = 2,
        groups: int = 2,
        nonfinite_at: Sequence[int] = (),
        gate: tuple[int, Path] | None = None,
        drift_at: int | None = None,
    ):
        """`gate` (step, path): before that step, wait until the file exists (a test's event, never a sleep).
        `drift_at`: after that step's update, rank 1's group 0 holds another lr (what the applied check must catch)."""
        self.groups = [[dict(optimizer_values) for _ in range(groups)] for _ in range(ranks)]
        self.weight, self.steps_done = 1.0, 0
        self.nonfinite_at = set(nonfinite_at)
        self.calls: list[dict[str, Any] | None] = []
        self.saved: list[int] = []
        self.shut_down = False
        self.gate = gate
        self.evaluations = 0
        self.drift_at = drift_at
        self.readied = False

    def ready(self) -> None:
        self.readied = True

    def train_step(self, examples: Sequence[Any], optim_step_params: dict[str, Any] | None) -> StepResult:
        assert self.readied, "train_step before ready()"
        if self.gate is not None and self.steps_done == self.gate[0]:
            deadline = time.monotonic() + 600
            while not self.gate[1].exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        builtin_params(optim_step_params)
        self.calls.append(optim_step_params)
        for groups in self.groups:
            for group in groups:
                group.update(optim_step_params or {})
        step, self.steps_done = self.steps_done, self.steps_done + 1
        loss = self.weight**2 + 0.01 * len(examples)
        if step in self.nonfinite_at:
            return StepResult(loss=float("nan"), grad_norm=float("nan"), applied=self.groups)
        lr, (beta1, _), wd = self.groups[0][0]["lr"], self.groups[0][0]["betas"], self.groups[0][0]["weight_decay"]
        self.weight -= lr * (2 * self.weight) * (1 - beta1 / 10) + lr * wd * self.weight
        if step == self.drift_at:
            self.groups[1][0]["lr"] = 7e-4
        return StepResult(loss=loss, grad_norm=abs(2 * self.weight), applied=[[dict(g) for g in r] for r in self.groups])

    def evaluate(self, examples: Sequence[Any]) -> float:
        """Reads the state, changes nothing (as verl's infer_batch): a function of the weight and the batch."""
        self.evaluations += 1
        return self.weight**2 + 0.5 + 0.001 * sum(sum(e.loss_mask) for e in examples) / len(examples)

    def evaluate_batches(self, batches: Sequence[Sequence[Any]]) -> list[float]:
        return [self.evaluate(batch) for batch in batches]

    def save_checkpoint(self, folder: Path, step: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for rank, groups in enumerate(self.groups):
            state = {"weight": self.weight, "steps_done": self.steps_done, "groups": groups}
            (folder / f"fake_rank_{rank}.json").write_text(json.dumps(state))
        self.saved.append(step)

    def load_checkpoint(self, folder: Path) -> None:
        state = json.loads((folder / "fake_rank_0.json").read_text())
        self.weight, self.steps_done = state["weight"], state["steps_done"]
        self.groups = [[{**g, "betas": tuple(g["betas"])} for g in state["groups"]] for _ in self.groups]

    def shutdown(self) -> None:
        self.shut_down = True


def fake_workers(**kwargs: Any):
    """A start for `GivenWorkers` (tinker_exp.run.run's place) that builds FakeWorkers (and keeps them for the test to inspect)."""
    started: list[FakeWorkers] = []

    def start(cfg, plan, model_path, run_dir, choice=None) -> FakeWorkers:
        workers = FakeWorkers(plan.optimizer_values, **kwargs)
        started.append(workers)
        return workers

    start.started = started  # type: ignore[attr-defined]
    return start
