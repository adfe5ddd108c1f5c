"""The training loop: one explicit Tinker step per iteration, and what was requested vs applied."""

from __future__ import annotations

import time
from typing import Any

from tinker_exp.data import batch_for_step
from tinker_exp.overrides import flat_values


class AppliedMismatchError(RuntimeError):
    """A param group on some rank does not hold what was sent: the run must not go on silently."""


def check_applied(step: int, requested: dict[str, Any], applied: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Every param group on every rank holds exactly the requested value and type; return rank 0's group 0."""
    for rank, groups in enumerate(applied):
        for index, group in enumerate(groups):
            for key, want in requested.items():
                got = group.get(key)
                if type(got) is not type(want) or got != want:
                    raise AppliedMismatchError(
                        f"step {step}: rank {rank} param group {index} holds {key}={got!r}, "
                        f"but {want!r} was requested"
                    )
    return applied[0][0]


def train(cfg: Any, plan: Any, workers: Any, examples: list, sinks: Any) -> dict[str, Any]:
    """Run cfg.trainer.steps Tinker steps; returns the last logged row."""
    row: dict[str, Any] = {}
    for step in range(cfg.trainer.steps):
        batch = batch_for_step(examples, step, cfg.trainer.batch_size, cfg.trainer.seed, cfg.data.shuffle)
        requested = plan[step]

        start = time.perf_counter()
        result = workers.train_step(batch, requested)  # zero_grad -> forward_backward -> optimizer_step
        step_time = time.perf_counter() - start

        applied = check_applied(step, requested, result.applied)
        tokens = sum(len(example.input_ids) for example in batch)
        row = {
            "train/step": step,
            "time": time.time(),
            "train/loss": result.loss,
            "train/grad_norm": result.grad_norm,
            "perf/step_time_s": step_time,
            "perf/tokens_per_s": tokens / step_time,
            **flat_values("requested", requested),
            **flat_values("applied", applied),
        }
        sinks.log(row)
    return row
