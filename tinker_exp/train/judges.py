"""Judges: what acts at an evaluation (early stop, a study's pruner, a population's member, any later one).

Shaped after Ray Tune's TrialScheduler (CONTINUE / STOP / exploit) and Lightning's callbacks (one list, called in
order). The loop holds a list of judges and calls, for every judge, in the list's order:

    begin(start)                    once, before the first step (a resume: a judge reads its state back, may
                                    answer load-and-continue)
    at each evaluation:
      evaluated(steps_done, row)    before the checkpoint of that step: its answer goes into the checkpoint's
                                    loop.json; the first stop wins (the judges after it are not asked)
      wants_checkpoint(steps_done)  a checkpoint is saved at this step if any judge wants one
      saved(steps_done, row, path)  after that checkpoint, for each judge that wanted it (e.g. a member posts it)
    loop_state()                    into every checkpoint's loop.json (a resumed judge gets it back in begin)
    end(sink)                       after the last step, or a stop (log lines, W&B tables)

Each answer is one Decision: go on, stop here, or load a checkpoint and continue with a plan. A judge subclasses
`Judge`, overrides only the hooks it needs, and builds itself for a run with a classmethod
`for_run(cfg, run_dir, job_number, wandb_config)` (None: not in this run). tinker_exp/assemble.py `JUDGES` lists
them all: adding a judge is its own module and one line there. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    from tinker_exp.optim import Plan
    from tinker_exp.train.protocols import TableSink
    from tinker_exp.train.start import StartPoint


@dataclass(frozen=True, eq=False)
class Decision:
    """A judge's answer. GO_ON; `stop(...)`; or `continue_from(...)`."""

    stop_line: str | None = None
    """Not None: the run ends at this step, after its checkpoint is saved; the line the terminal gets."""
    stop_state: Mapping[str, Any] = field(default_factory=dict)
    """With a stop: what that checkpoint's loop.json records of it (a resumed stopped run is complete)."""
    plan: Plan | None = None
    """The plan from here on (None: the plan as it is)."""
    checkpoint: Path | None = None
    """A checkpoint the running workers load before the next step (None: they go on as they are)."""
    nonfinite_steps: int | None = None
    """With a checkpoint: its count of non-finite steps (None: the count goes on)."""

    @property
    def stops(self) -> bool:
        return self.stop_line is not None

    @property
    def goes_on(self) -> bool:
        """Nothing to do: no stop, no plan, no checkpoint."""
        return not self.stops and self.plan is None and self.checkpoint is None


GO_ON = Decision()


def stop(line: str, **loop_state: Any) -> Decision:
    """End the run here; `loop_state`: what its checkpoint records (early_stopped=True, pruned=True, ...)."""
    return Decision(stop_line=line, stop_state=loop_state)


def continue_from(plan: Plan, checkpoint: Path | None = None, nonfinite_steps: int | None = None) -> Decision:
    """Go on with `plan`, from `checkpoint` loaded into the running workers when given (an exploit)."""
    return Decision(plan=plan, checkpoint=checkpoint, nonfinite_steps=nonfinite_steps)


class Judge(Protocol):
    """What acts at an evaluation. Subclass it and override what you need: every hook's default does nothing."""

    def begin(self, start: StartPoint) -> Decision:
        """Before the first step, the workers ready.

        A resume's checkpoint is not yet loaded: a `continue_from` with a checkpoint loads that one instead."""
        return GO_ON

    def evaluated(self, steps_done: int, row: Mapping[str, Any]) -> Decision:
        """After an evaluation (its values in `row`), before the checkpoint of this step: GO_ON or a stop."""
        return GO_ON

    def wants_checkpoint(self, steps_done: int) -> bool:
        """At an evaluation: True to have a checkpoint saved at this step and `saved` called with it."""
        return False

    def saved(self, steps_done: int, row: Mapping[str, Any], checkpoint: Path) -> Decision:
        """After the checkpoint this judge wanted at this step is saved: GO_ON or a `continue_from`."""
        return GO_ON

    def loop_state(self) -> dict[str, Any]:
        """What every checkpoint's loop.json records of this judge (its keys are its own)."""
        return {}

    def end(self, sink: TableSink) -> None:
        """After the last step or a stop (not after a failure)."""


class Judges:
    """A run's judges, asked in order; what the loop calls."""

    def __init__(self, judges: Sequence[Judge] = ()):
        self.judges = list(judges)

    def begin(self, start: StartPoint) -> Decision:
        """Every judge's start; the last one that loads or plans something is what applies."""
        answers = [judge.begin(start) for judge in self.judges]
        return next((answer for answer in reversed(answers) if not answer.goes_on), GO_ON)

    def evaluated(self, steps_done: int, row: Mapping[str, Any]) -> Decision:
        """The first stop; the judges after it are not asked (a pruned run's early stop counts no evaluation)."""
        for judge in self.judges:
            answer = judge.evaluated(steps_done, row)
            if answer.stops:
                return answer
        return GO_ON

    def wanting_checkpoint(self, steps_done: int) -> list[Judge]:
        return [judge for judge in self.judges if judge.wants_checkpoint(steps_done)]

    def loop_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for judge in self.judges:
            state.update(judge.loop_state())
        return state

    def end(self, sink: TableSink) -> None:
        for judge in self.judges:
            judge.end(sink)
