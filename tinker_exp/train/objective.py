"""What a run reports to Hydra's sweeper: one metric of its metrics.jsonl, its last or lowest value. Pure Python."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from tinker_exp.config import Config
from tinker_exp.errors import ConfigError
from tinker_exp.formats import read_json
from tinker_exp.train.evaluation import missing_evaluation_data

OBJECTIVE_FILE = "objective.json"  # written by a run that completed: what it returned to the sweeper

TRAIN_METRICS = ("train/loss", "train/grad_norm", "train/nonfinite_steps", "perf/step_time_s", "perf/tokens_per_s")
VAL_METRICS = ("val/loss", "val/tokens", "perf/eval_time_s")
RL_TRAIN_METRICS = ("train/reward", "train/reward_std", "train/degenerate_groups", "train/response_length",
                    "train/pg_loss", "train/ppo_kl", "train/mismatch", "train/clip_fraction")  # fmt: skip
RL_EVAL_METRICS = ("eval/reward", "eval/reward_std", "perf/eval_time_s")


HIGHER_IS_BETTER = ("train/reward", "eval/reward")
"""Metrics a run wants high (rewards): with trainer.objective_mode=last they are maximised; every other metric
(a loss) is minimised unless the mode is max."""


def has_validation(cfg: Config) -> bool:
    """Whether the run evaluates: held-out rows (SFT) or held-out prompts (RL, env.eval_prompts)."""
    return missing_evaluation_data(cfg) is None


def objective_metric(cfg: Config) -> str:
    """trainer.objective, checked against what the run logs.

    By default val/loss (train/loss without validation), for RL eval/reward (train/reward without held-out prompts).
    `cfg`: the typed config or a sweep's DictConfig."""
    rl = getattr(cfg.env, "prompts", None) is not None
    logged = TRAIN_METRICS + (RL_TRAIN_METRICS if rl else ()) + (((RL_EVAL_METRICS if rl else VAL_METRICS)) if has_validation(cfg) else ())
    metric = cfg.trainer.objective or (
        ("eval/reward" if has_validation(cfg) else "train/reward") if rl else ("val/loss" if has_validation(cfg) else "train/loss")
    )
    if metric not in logged and not metric.startswith(("requested/", "applied/")):
        why = " (there is no validation data)" if metric in VAL_METRICS else ""
        raise ConfigError(f"trainer.objective: {metric!r} is never logged{why}; logged: {list(logged)}")
    return metric


def maximised(metric: str, mode: str) -> bool:
    """Whether a run's objective is maximised: with objective_mode=max, and with last on a reward; never with min.

    The rewards: HIGHER_IS_BETTER. Early stop, keep_best, a study's direction, a population's ranking and the summaries
    follow it."""
    return mode == "max" or (mode == "last" and metric in HIGHER_IS_BETTER)


def objective_sign(cfg: Config) -> int:
    """1 when lower is better (a loss), -1 when the objective is maximised (a reward): sign * value is minimised."""
    mode = str(getattr(cfg.trainer.objective_mode, "value", cfg.trainer.objective_mode))
    return -1 if maximised(objective_metric(cfg), mode) else 1


def objective_value(rows: Sequence[dict[str, Any]], metric: str, mode: str) -> float | None:
    """The metric's last (mode "last"), lowest ("min") or highest ("max") value in the rows; None when no row has it."""
    values = [row[metric] for row in rows if metric in row]
    if not values:
        return None
    return min(values) if mode == "min" else max(values) if mode == "max" else values[-1]


def write_objective(
    run_dir: Path, metric: str, mode: str, value: float | None, best: dict[str, Any] | None = None,
    steps: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """Write objective.json when a run completed: what it returned.

    A study continued after a kill reads it back. `best`: the kept best checkpoint (checkpoint.keep_best), its step,
    value and path. `steps`: steps trained and planned, and pruned_at_step when its study's pruner stopped it."""
    doc = {"metric": metric, "mode": mode, "maximised": maximised(metric, mode), "value": value, **({"best_checkpoint": best} if best else {}), **(steps or {})}
    (run_dir / OBJECTIVE_FILE).write_text(json.dumps(doc) + "\n")


def read_objective(run_dir: Path) -> float | None:
    """The value a completed run returned; None when it did not complete (no file) or has no finite value."""
    value = (read_json(run_dir / OBJECTIVE_FILE) or {}).get("value")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def no_objective(value: Any) -> str:
    """Why a run that completed fails its trial: it returned no finite objective (`value`: what it returned)."""
    return f"the run returned no finite objective ({value!r})"


def read_run_end(run_dir: Path) -> dict[str, Any]:
    """objective.json of a run that completed ({} otherwise): its steps trained and planned, pruned_at_step."""
    return read_json(run_dir / OBJECTIVE_FILE) or {}


def was_maximised(end: Mapping[str, Any]) -> bool:
    """Whether a run's objective was maximised, as its objective.json (`end`) says.

    A file from before "maximised": its mode max. The summaries and report.png rank runs by it."""
    return bool(end.get("maximised", end.get("mode") == "max"))


def ranking_key(objective: float | None, higher: bool) -> float:
    """Sort key of an objective, best first: lower, or higher when maximised.

    None (no objective) is the caller's to put last."""
    return 0.0 if objective is None else (-objective if higher else objective)


def came_to(rows: Sequence[dict[str, Any]]) -> str:
    """What a run came to, in words (its last line, an RL run's report title).

    An RL run's reward first (its last step's train/reward, its highest eval/reward over `rows`), not its
    policy-gradient loss; an SFT run's final train and val loss."""
    last = rows[-1]
    if "train/reward" in last:
        evaluated = [row for row in rows if "eval/reward" in row]
        best = max(evaluated, key=lambda row: row["eval/reward"], default=None)  # the first of equal highs
        at_best = "" if best is None else f", best eval/reward {best['eval/reward']:.4f} after {best['train/step'] + 1} steps"
        return f"last reward {last['train/reward']:.4f}{at_best}"
    val = f", val loss {last['val/loss']:.4f}" if "val/loss" in last else ""
    return f"final loss {last['train/loss']:.4f}{val}"
