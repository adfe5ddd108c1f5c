"""Early stop (trainer.early_stop): a judge that ends the run when the objective stops improving. Pure Python."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from tinker_exp.config import Config
from tinker_exp.errors import ConfigError
from tinker_exp.train.judges import GO_ON, Decision, Judge, stop
from tinker_exp.train.objective import has_validation, objective_metric, objective_sign
from tinker_exp.train.start import StartPoint

STATE = "watch"
"""Its key in every checkpoint's loop.json (beside `early_stopped`, which a resume reads as "complete")."""


def check_early_stop(cfg: Config) -> None:
    """Refuse early stop without validation data or evaluations before the last step.

    Early stop counts evaluations: patience of them after the first, without improvement, stop the run; the evaluation
    after the last step stops nothing."""
    trainer = cfg.trainer
    patience = trainer.early_stop.patience
    if not patience:
        return
    given = f"trainer.early_stop.patience={patience}"
    if not has_validation(cfg):
        raise ConfigError(
            f"{given}: early stop counts evaluations, and there is no validation data (data.val_path or data.val_fraction)"
        )
    if not trainer.eval_every:
        raise ConfigError(
            f"{given}: trainer.eval_every=0 evaluates only after the last step; early stop could never stop the run "
            f"(set trainer.eval_every=N, N < trainer.steps)"
        )
    during = (trainer.steps - 1) // trainer.eval_every  # evaluations before the last step
    if during < patience + 1:
        raise ConfigError(
            f"{given}: trainer.eval_every={trainer.eval_every} evaluates {during} time{'s' * (during != 1)} before the "
            f"last of trainer.steps={trainer.steps}; early stop needs {patience + 1} (a first, then {patience} without "
            "improvement), so it could never stop the run"
        )


class EarlyStop(Judge):
    """Stop a run whose objective has not improved for `patience` evaluations in a row.

    It follows the objective metric at each evaluation (lower is better; higher with objective_mode=max): the best so
    far and its step, and whether `patience` evaluations in a row brought no improvement of at least `min_delta`. Its
    state goes into every checkpoint, so a resumed run counts on."""

    def __init__(self, metric: str, patience: int, min_delta: float, sign: int = 1):
        self.metric, self.patience, self.min_delta = metric, patience, min_delta
        self.sign = sign  # -1: higher is better (objective_mode=max)
        self.best: float | None = None
        self.best_step: int | None = None
        self.stale = 0

    @classmethod
    def for_run(cls, cfg: Config, run_dir: Path, job_number: int | None, wandb_config: dict[str, Any]) -> "EarlyStop | None":
        early = cfg.trainer.early_stop
        return cls(objective_metric(cfg), early.patience, early.min_delta, objective_sign(cfg)) if early.patience else None

    def begin(self, start: StartPoint) -> Decision:
        state = start.loop_state.get(STATE) or {}
        self.best, self.best_step, self.stale = state.get("best"), state.get("best_step"), state.get("stale", 0)
        return GO_ON

    def evaluated(self, steps_done: int, row: Mapping[str, Any]) -> Decision:
        value = row.get(self.metric)
        if value is None or not math.isfinite(value):
            return GO_ON
        if self.best is None or self.sign * value < self.sign * self.best - self.min_delta:
            self.stale = 0
        else:
            self.stale += 1
        if self.best is None or self.sign * value < self.sign * self.best:
            self.best, self.best_step = value, steps_done
        if self.patience and self.stale >= self.patience:
            line = f"early stop at step {steps_done}: best {self.metric} {self.best:.6g} at step {self.best_step}"
            return stop(line, early_stopped=True)
        return GO_ON

    def loop_state(self) -> dict[str, Any]:
        return {STATE: {"best": self.best, "best_step": self.best_step, "stale": self.stale}, "early_stopped": False}
