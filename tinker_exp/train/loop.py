"""The training loop: one explicit Tinker step per iteration, and what was requested vs applied."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Sequence

from tinker_exp.config import TrainerConfig
from tinker_exp.errors import AppliedMismatchError, NonFiniteError
from tinker_exp.optim import Plan, flat_values
from tinker_exp.optim.optimizers import SCHEDULED_LR
from tinker_exp.train.checkpoints import Checkpointer, restore, saved_loop_state
from tinker_exp.train.evaluation import Evaluation
from tinker_exp.train.judges import GO_ON, Decision, Judge, Judges
from tinker_exp.train.protocols import BatchSource, TableSink, Workers
from tinker_exp.train.signals import stop_if_terminated
from tinker_exp.train.start import StartPoint

log = logging.getLogger(__name__)
BATCH_SOURCE = "batch_source"
"""The batch source's key in a checkpoint's loop.json (absent when its state is empty, as the data file's)."""


def check_applied(step: int, requested: dict[str, Any], applied: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Check every param group on every rank holds exactly the requested value and type; return rank 0's group 0.

    Rank 0's group 0 as its step applied it: the lr is the one the optimizer scaled itself where it does (SCHEDULED_LR,
    schedule-free's warmup), not the one it holds."""
    for rank, groups in enumerate(applied):
        for index, group in enumerate(groups):
            for key, want in requested.items():
                got = group.get(key)
                if type(got) is not type(want) or got != want:
                    raise AppliedMismatchError(
                        f"step {step}: rank {rank} param group {index} holds {key}={got!r}, "
                        f"but {want!r} was requested"
                    )
    first = applied[0][0]
    return {**first, "lr": first[SCHEDULED_LR]} if SCHEDULED_LR in first else first


def train(
    trainer: TrainerConfig,
    plan: Plan,
    workers: Workers,
    batches: BatchSource,
    sink: TableSink,
    checkpointer: Checkpointer | None = None,
    start: StartPoint | None = None,
    evaluation: Evaluation | None = None,
    judges: Sequence[Judge] = (),
) -> dict[str, Any]:
    """Run Tinker steps from `start` (step 0, or a checkpoint: loaded here) to trainer.steps; returns the last row.

    After each step: evaluate when due (its values join the step's row), log it, stop if non-finite steps exceed the
    limit (before any save, so the last checkpoint is from before the failure), ask the judges (train/judges.py) at an
    evaluation, then save a checkpoint when one is due, a judge stops the run or wants one. A stop ends the run after
    that checkpoint; a judge that wanted it then says how the run goes on (a plan, a checkpoint to load).
    """
    start = start or StartPoint()
    panel = Judges(judges)
    opening = panel.begin(start)
    if opening.checkpoint is None and start.checkpoint is not None:
        restore(workers, start.checkpoint.path)
    batches.restore(start.loop_state.get(BATCH_SOURCE, {}))
    plan, nonfinite_steps = follow(opening, workers, batches, plan, start.loop_state.get("nonfinite_steps", 0))
    row: dict[str, Any] = {}
    for step in range(start.step, trainer.steps):
        stop_if_terminated()  # a SIGTERM whose exception a library lost still stops the run, here
        batch = batches.batch(step)
        requested = plan[step]

        start_time = time.perf_counter()
        result = workers.train_step(batch.examples, requested)  # forward_backward -> optimizer_step
        step_time = time.perf_counter() - start_time

        applied = check_applied(step, requested, result.applied)
        nonfinite_steps += not (math.isfinite(result.loss) and math.isfinite(result.grad_norm))
        tokens = sum(len(example.input_ids) for example in batch.examples)
        row = {
            "train/step": step,
            "time": time.time(),
            "train/loss": result.loss,
            "train/grad_norm": result.grad_norm,
            "train/nonfinite_steps": nonfinite_steps,
            "perf/step_time_s": step_time,
            "perf/tokens_per_s": tokens / step_time,
            **batch.measured,
            **result.metrics,
            **flat_values("requested", requested),
            **flat_values("applied", applied),
        }
        evaluated = evaluation is not None and evaluation.due(step + 1)
        if evaluated:
            row.update(evaluation.run(workers, step + 1))
        sink.log(row)
        if nonfinite_steps > trainer.max_nonfinite_steps:
            raise NonFiniteError(
                f"step {step}: loss={result.loss}, grad_norm={result.grad_norm}; {nonfinite_steps} non-finite "
                f"step(s), trainer.max_nonfinite_steps={trainer.max_nonfinite_steps}"
            )
        verdict = panel.evaluated(step + 1, row) if evaluated else GO_ON
        wanting = panel.wanting_checkpoint(step + 1) if evaluated and not verdict.stops else []
        assert checkpointer is not None or not wanting, "a judge's checkpoints need a checkpointer"
        if checkpointer is not None and (checkpointer.due(step + 1) or verdict.stops or wanting):
            source = batches.state()
            state = {"nonfinite_steps": nonfinite_steps, **({BATCH_SOURCE: source} if source else {}),
                     **panel.loop_state(), **verdict.stop_state}  # fmt: skip
            saved = checkpointer.save(step + 1, state, row if evaluated else None)
            log.info(f"checkpoint: {saved}")
        if verdict.stops:
            log.info(verdict.stop_line)
            break
        for judge in wanting:  # e.g. a member posts the checkpoint and may take another's, with a new plan
            plan, nonfinite_steps = follow(judge.saved(step + 1, row, saved), workers, batches, plan, nonfinite_steps)
    panel.end(sink)
    return row


def follow(decision: Decision, workers: Workers, batches: BatchSource, plan: Plan, nonfinite_steps: int) -> tuple[Plan, int]:
    """The plan and non-finite count after a judge's decision, its checkpoint (if any) loaded.

    The checkpoint is loaded into the workers and the batch source. A checkpoint is a run's whole state: an exploit
    continues the donor's run (its weights, optimizer and RNG, and its batch source's state: an RL run's prompt cursor
    and sampler RNG) with a new plan, so a member's lineage is one run whose plan changed, and its realized schedule
    replays it from step 0."""
    if decision.checkpoint is not None:
        restore(workers, decision.checkpoint)
        batches.restore(saved_loop_state(decision.checkpoint).get(BATCH_SOURCE, {}))
        if decision.nonfinite_steps is not None:
            nonfinite_steps = decision.nonfinite_steps
    return (plan if decision.plan is None else decision.plan), nonfinite_steps
