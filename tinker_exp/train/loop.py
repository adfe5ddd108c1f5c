"""The training loop: one explicit Tinker step per iteration, and what was requested vs applied."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Sequence

from tinker_exp.config import TrainerConfig
from tinker_exp.errors import AppliedMismatchError, NonFiniteError
from tinker_exp.optim import Plan, flat_values
from tinker_exp.train.checkpoints import Checkpointer, restore
from tinker_exp.train.evaluation import Evaluation
from tinker_exp.train.objective import Watch
from tinker_exp.train.protocols import Boundaries, Sink, Watcher, Workers

log = logging.getLogger(__name__)


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


def train(
    trainer: TrainerConfig,
    plan: Plan,
    workers: Workers,
    batch_for: Callable[[int], Sequence[Any]],
    sink: Sink,
    checkpointer: Checkpointer | None = None,
    start: dict[str, Any] | None = None,
    evaluation: Evaluation | None = None,
    watch: Watch | None = None,
    trial: Watcher | None = None,
    member: Boundaries | None = None,
) -> dict[str, Any]:
    """Run Tinker steps from `start` (a checkpoint's loop state; None: step 0) to trainer.steps.

    After each step: evaluate when due (its values join the step's row), log it, stop if non-finite steps exceed the limit (before any save, so the last
    checkpoint is from before the failure), then save a checkpoint when one is due. `watch` sees each evaluation: when
    it says stop (early stop), the run saves a checkpoint at that step and ends; `trial` (a study's trial) sees it
    first, and ends the run the same way when its pruner says so. `member` (a population's member): at each of its
    boundaries a checkpoint is saved, then it decides; on an exploit the donor's checkpoint is loaded into these same
    workers and the member's new plan applies from there. Returns the last row.
    """
    assert member is None or checkpointer is not None, "a member's boundaries save checkpoints"
    start = start or {}
    nonfinite_steps = start.get("nonfinite_steps", 0)
    row: dict[str, Any] = {}
    for step in range(start.get("step", 0), trainer.steps):
        batch = batch_for(step)
        requested = plan[step]

        start_time = time.perf_counter()
        result = workers.train_step(batch, requested)  # forward_backward -> optimizer_step
        step_time = time.perf_counter() - start_time

        applied = check_applied(step, requested, result.applied)
        nonfinite_steps += not (math.isfinite(result.loss) and math.isfinite(result.grad_norm))
        tokens = sum(len(example.input_ids) for example in batch)
        row = {
            "train/step": step,
            "time": time.time(),
            "train/loss": result.loss,
            "train/grad_norm": result.grad_norm,
            "train/nonfinite_steps": nonfinite_steps,
            "perf/step_time_s": step_time,
            "perf/tokens_per_s": tokens / step_time,
            **flat_values("requested", requested),
            **flat_values("applied", applied),
        }
        evaluated = evaluation is not None and evaluation.due(step + 1)
        if evaluated:
            row.update(evaluation.run(workers))
        sink.log(row)
        if nonfinite_steps > trainer.max_nonfinite_steps:
            raise NonFiniteError(
                f"step {step}: loss={result.loss}, grad_norm={result.grad_norm}; {nonfinite_steps} non-finite "
                f"step(s), trainer.max_nonfinite_steps={trainer.max_nonfinite_steps}"
            )
        pruned = evaluated and trial is not None and trial.seen(step + 1, row)
        stop = pruned or (evaluated and watch is not None and watch.seen(step + 1, row))
        boundary = evaluated and member is not None and member.due(step + 1)
        if checkpointer is not None and (checkpointer.due(step + 1) or stop or boundary):
            state = {"nonfinite_steps": nonfinite_steps, **({"watch": watch.state(), "early_stopped": stop} if watch else {})}
            if pruned:  # a resumed pruned run is complete, as an early-stopped one
                state.update(early_stopped=True, pruned=True)
            saved = checkpointer.save(step + 1, state, row if evaluated else None)
            log.info(f"checkpoint: {saved}")
        if stop:
            log.info((trial if pruned else watch).stop_line(step + 1))
            break
        if boundary:  # post, decide; an exploit swaps the workers' state and the plan, nothing else
            turn = member.boundary(step + 1, row, saved)
            if turn.checkpoint is not None:
                restore(workers, turn.checkpoint)
                nonfinite_steps = nonfinite_steps if turn.nonfinite_steps is None else turn.nonfinite_steps
            plan = turn.plan
    return row
