"""Runs as a law sees them: the lr sent at every step from 0 and the loss at the steps it was logged.

A RUN is a run dir, a sweep dir (every job in it) or a metrics.jsonl-format file from anywhere. A branch's run
dir is joined with its trunk's steps before the branch point (tinker_exp.optim.preview.history). Pure Python
and numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tinker_exp.errors import ConfigError
from tinker_exp.formats import display_name, read_jsonl

METRICS = "metrics.jsonl"
LR_KEY = "applied/lr"
METRIC_CHOICES = ("train/loss", "val/loss")
# What the fitted runs must share for one law to describe them (the peak lr is checked from applied/lr).
# optimizer.lr is left out: the override's peak is what is sent.
SHARED_PREFIXES = ("model.", "lora.", "optimizer.", "data.path", "data.format", "data.max_length", "trainer.batch_size")
NOT_SHARED = ("model.cache_dir", "optimizer.lr")


class ForecastError(ConfigError):
    """Bad input to the forecast: one line naming the file or key, exit 2."""

    label = "forecast error"


class NotConverged(ForecastError):
    """The law's fit did not converge: no law.json is written."""

    exit_code = 1
    label = "fit did not converge"


def updates_seen(metric: str, steps: np.ndarray) -> np.ndarray:
    """Updates behind a logged loss, at each of `steps`.

    train/loss at step t is computed before step t's update (t), val/loss after it (t + 1)."""
    return steps + (1 if metric.startswith("val/") else 0)


@dataclass
class Curve:
    """One run's lr at every update and its metric where logged.

    `lr[i]` the lr sent with update i (steps 0..len-1), the metric at `steps`, and for each point the run dir (or file)
    that logged it (a branch's points before its branch step are its trunk's)."""

    name: str
    path: Path
    lr: np.ndarray
    steps: np.ndarray
    loss: np.ndarray
    sources: list[str]
    settings: dict[str, Any] = field(default_factory=dict)
    rewarded: bool = False  # its rows log train/reward: an RL run's, whatever its config (a metrics.jsonl has none)

    @property
    def peak(self) -> float:
        return float(self.lr.max())


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys -> the value as written (lists whole): a proposed run repeats some."""
    if not isinstance(tree, dict):
        return {prefix: tree} if prefix else {}
    found: dict[str, Any] = {}
    for key, value in tree.items():
        found.update(flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


def run_settings(run_dir: Path) -> dict[str, Any]:
    """config.yaml flattened ("trainer.batch_size" -> 8); {} for a file or a dir without one."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    import yaml

    try:
        return flat(yaml.safe_load(path.read_text(encoding="utf-8")))
    except (OSError, yaml.YAMLError):
        return {}


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and (path / METRICS).is_file()


def expand(paths: list[Path]) -> list[Path]:
    """Run dirs and files for the paths given: a sweep dir stands for its jobs (subdirs with metrics.jsonl)."""
    found: list[Path] = []
    for path in paths:
        if path.is_file() or is_run_dir(path):
            found.append(path)
            continue
        jobs = sorted((d for d in path.iterdir() if is_run_dir(d)), key=lambda d: (not d.name.isdigit(), d.name.zfill(9))) if path.is_dir() else []
        if not jobs and path.is_dir() and ((path / "plan.json").is_file() or (path / "config.yaml").is_file()):
            raise ForecastError(f"{path}: no {METRICS} (a dry run, or a run that logged no step: a forecast needs a run's losses)")
        if not jobs:
            raise ForecastError(f"{path}: not a run dir, a sweep dir or a {METRICS} file")
        found.extend(jobs)
    return found


def _rows_of(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(source, row) for every step of a run: a branch's trunk steps before the branch point first."""
    if path.is_file():
        return [(str(path), row) for row in read_jsonl(path)]
    from tinker_exp.optim.preview import history

    rows = []
    for part in history(path):
        metrics = part.run_dir / METRICS
        if not metrics.is_file():
            raise ForecastError(f"{metrics}: missing (the run's steps {part.first}.. are read from it)")
        source = str(part.run_dir.resolve())
        rows += [(source, row) for row in read_jsonl(metrics) if isinstance(row.get("train/step"), int) and part.holds(row["train/step"])]
    return rows


def read_curve(path: Path, metric: str) -> Curve:
    """The run's lr at every step and its metric where logged.

    ForecastError naming the file when the lr is not there at every step from 0 or the metric never is."""
    where = path / METRICS if path.is_dir() else path
    rows = _rows_of(path)
    lr: dict[int, float] = {}
    points: dict[int, tuple[float, str]] = {}
    rewarded = any("train/reward" in row for _, row in rows)
    for source, row in rows:
        step = row.get("train/step")
        if not isinstance(step, int):
            continue
        if isinstance(row.get(LR_KEY), (int, float)):
            lr[step] = float(row[LR_KEY])
        value = row.get(metric)
        if isinstance(value, (int, float)) and math.isfinite(value):
            points[step] = (float(value), source)
    if not lr:
        raise ForecastError(f"{where}: no {LR_KEY} (the run sent no lr: a forecast needs an lr override, e.g. +override.lr=1e-3)")
    last = max(lr)
    missing = sorted(set(range(last + 1)) - set(lr))
    if missing:
        raise ForecastError(f"{where}: {LR_KEY} missing at step {missing[0]} ({len(missing)} steps of 0..{last}; a forecast needs the lr sent at every step from 0)")
    if not points:
        raise ForecastError(f"{where}: no {metric} logged")
    steps = np.array(sorted(points), dtype=np.int64)
    return Curve(
        name=display_name(path),
        path=path,
        lr=np.array([lr[s] for s in range(last + 1)]),
        steps=steps,
        loss=np.array([points[s][0] for s in steps]),
        sources=[points[s][1] for s in steps],
        settings=run_settings(path) if path.is_dir() else {},
        rewarded=rewarded,
    )


def refuse_rl(curves: list[Curve]) -> None:
    """Refuse RL runs: their train/loss is a policy-gradient surrogate (often <= 0), not the loss the laws describe.

    Refused by its config or, for a metrics.jsonl file alone, by its rows (they log train/reward), whatever the sign of
    its losses."""
    for curve in curves:
        prompts = curve.settings.get("env.prompts")
        if prompts or curve.rewarded:
            why = f"env.prompts {prompts}" if prompts else "it logs train/reward"
            raise ForecastError(f"{curve.path}: an RL run ({why}): its train/loss is a policy-gradient loss, not the falling "
                                "pretraining or SFT loss the laws describe")  # fmt: skip


def shared_keys(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if k.startswith(SHARED_PREFIXES) and k not in NOT_SHARED}


def check_comparable(curves: list[Curve]) -> None:
    """One law describes runs of one model, data set, batch size and peak lr: refuse others, naming the key."""
    first = curves[0]
    for other in curves[1:]:
        if not math.isclose(other.peak, first.peak, rel_tol=1e-9):
            raise ForecastError(f"{LR_KEY} (peak): {first.name} peaks at {first.peak:g}, {other.name} at {other.peak:g}; fitted runs must share the peak lr")
        mine, theirs = shared_keys(first.settings), shared_keys(other.settings)
        for key in sorted(set(mine) & set(theirs)):
            if mine[key] != theirs[key]:
                raise ForecastError(f"{key}: {first.name} has {mine[key]}, {other.name} has {theirs[key]}; fitted runs must share model, data, batch size and optimizer")
