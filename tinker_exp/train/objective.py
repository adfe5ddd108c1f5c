"""What a run reports to Hydra's sweeper: one metric of its metrics.jsonl, its last or lowest value. Pure Python."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from tinker_exp.config import Config
from tinker_exp.errors import ConfigError
from tinker_exp.formats import read_json

OBJECTIVE_FILE = "objective.json"  # written by a run that completed: what it returned to the sweeper

TRAIN_METRICS = ("train/loss", "train/grad_norm", "train/nonfinite_steps", "perf/step_time_s", "perf/tokens_per_s")
VAL_METRICS = ("val/loss", "val/tokens", "perf/eval_time_s")


def has_validation(cfg: Config) -> bool:
    return cfg.data.val_path is not None or cfg.data.val_fraction is not None


def objective_metric(cfg: Config) -> str:
    """trainer.objective, checked against what the run logs; by default val/loss (train/loss without validation)."""
    logged = TRAIN_METRICS + (VAL_METRICS if has_validation(cfg) else ())
    metric = cfg.trainer.objective or ("val/loss" if has_validation(cfg) else "train/loss")
    if metric not in logged and not metric.startswith(("requested/", "applied/")):
        why = " (there is no validation data)" if metric in VAL_METRICS else ""
        raise ConfigError(f"trainer.objective: {metric!r} is never logged{why}; logged: {list(logged)}")
    return metric


def check_early_stop(cfg: Config) -> None:
    """Early stop counts evaluations: it needs validation data, and evaluations before the last step (patience
    of them after the first, without improvement, stop the run; the evaluation after the last step stops nothing)."""
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


class Watch:
    """The objective metric at each evaluation (lower is better): the best so far and its step, and whether
    `patience` evaluations in a row brought no improvement of at least `min_delta`. The loop calls `seen` after
    each evaluation; its `state` goes into every checkpoint, so a resumed run counts on."""

    def __init__(self, metric: str, patience: int, min_delta: float, state: dict[str, Any] | None = None):
        self.metric, self.patience, self.min_delta = metric, patience, min_delta
        state = state or {}
        self.best: float | None = state.get("best")
        self.best_step: int | None = state.get("best_step")
        self.stale: int = state.get("stale", 0)

    def seen(self, steps_done: int, row: dict[str, Any]) -> bool:
        """Record this evaluation's value; True when the run should stop here."""
        value = row.get(self.metric)
        if value is None or not math.isfinite(value):
            return False
        if self.best is None or value < self.best - self.min_delta:
            self.stale = 0
        else:
            self.stale += 1
        if self.best is None or value < self.best:
            self.best, self.best_step = value, steps_done
        return bool(self.patience) and self.stale >= self.patience

    def state(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "stale": self.stale}

    def stop_line(self, steps_done: int) -> str:
        return f"early stop at step {steps_done}: best {self.metric} {self.best:.6g} at step {self.best_step}"


def objective_value(rows: Sequence[dict[str, Any]], metric: str, mode: str) -> float | None:
    """The metric's last (mode "last") or lowest ("min") value in the rows; None when no row has it."""
    values = [row[metric] for row in rows if metric in row]
    if not values:
        return None
    return min(values) if mode == "min" else values[-1]


def write_objective(
    run_dir: Path, metric: str, mode: str, value: float | None, best: dict[str, Any] | None = None,
    steps: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """Written when a run completed: what it returned (a study continued after a kill reads it back). `best`:
    the kept best checkpoint (checkpoint.keep_best), its step, value and path. `steps`: steps trained and planned,
    and pruned_at_step when its study's pruner stopped it."""
    doc = {"metric": metric, "mode": mode, "value": value, **({"best_checkpoint": best} if best else {}), **(steps or {})}
    (run_dir / OBJECTIVE_FILE).write_text(json.dumps(doc) + "\n")


def read_objective(run_dir: Path) -> float | None:
    """The value a completed run returned; None when it did not complete (no file) or has no finite value."""
    value = (read_json(run_dir / OBJECTIVE_FILE) or {}).get("value")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def read_run_end(run_dir: Path) -> dict[str, Any]:
    """objective.json of a run that completed ({} otherwise): its steps trained and planned, pruned_at_step."""
    return read_json(run_dir / OBJECTIVE_FILE) or {}
