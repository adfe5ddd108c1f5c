"""Candidate schedules: PLANs composed exactly as a run composes them, and the families `propose` searches.

A PLAN is a dry run's (or any run's) dir, whose plan.json is rebuilt, or the overrides a user types for a run,
in one argument ("+override=lr_cosine trainer.steps=400"): composed with Hydra from the repo's conf/ (and a
--config-dir), read as the typed Config and planned by the same build_plan a run uses. Pure Python (Hydra).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tinker_exp.forecast.runs import ForecastError, flat, run_settings


@dataclass(frozen=True)
class Candidate:
    name: str
    lr: np.ndarray  # the lr of every update, raw
    spec: dict[str, Any] | None = None  # the lr override that makes it (propose's candidates)
    settings: dict[str, Any] | None = None  # its run's config, flattened as runs.run_settings reads it (None: unknown)


def compose_config(overrides: list[str], config_dir: Path | None = None) -> Any:
    """The typed Config a run with these command-line overrides gets (conf/, and `config_dir`'s presets first)."""
    from tinker_exp.config import compose

    return compose(overrides, config_dir, job_name="forecast")


def plan_lr(text: str, config_dir: Path | None = None) -> Candidate:
    """A PLAN's lr at every step; ForecastError naming the PLAN when it does not compose or sends no lr."""
    from tinker_exp.errors import ConfigError

    path = Path(text)
    try:
        if path.is_dir():
            from tinker_exp.optim.preview import PLAN_FILE, read_plan_file

            try:
                plan = read_plan_file(path / PLAN_FILE)
            except (OSError, ValueError, KeyError) as e:
                raise ForecastError(f"{path / PLAN_FILE}: {e}") from None
            settings = run_settings(path) or run_settings(path / ".hydra") or None  # a dry run's: Hydra's record
        else:
            import yaml
            from omegaconf import OmegaConf

            from tinker_exp.optim import build_plan

            cfg = compose_config(shlex.split(text), config_dir)
            plan = build_plan(cfg.override, cfg.optimizer, cfg.trainer.steps)
            settings = flat(yaml.safe_load(OmegaConf.to_yaml(OmegaConf.structured(cfg))))  # as a run's config.yaml
    except ForecastError:
        raise
    except ConfigError as e:
        raise ForecastError(f"plan {text!r}: {e}") from None
    if "lr" not in plan.columns:
        raise ForecastError(f"plan {text!r}: sends no lr (give an lr schedule: +override=lr_cosine, +override.lr=...)")
    return Candidate(text, np.asarray(plan.column("lr"), dtype=np.float64), settings=settings)


DECAY_FRACTIONS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7)
FINAL_RATIOS = (0.0, 0.01, 0.1, 0.3)
SHAPES = ("1-sqrt", "linear", "cosine")
FAMILIES = ("wsd", "cosine", "linear")


def family_specs(family: str, steps: int, peak: float, warmup: int) -> list[dict[str, Any]]:
    """The lr overrides `propose` compares for a family.

    For WSD decay fraction x shape x final ratio; for cosine and linear the final ratio. Lengths in steps (a file that
    runs as is for exactly `steps` steps)."""
    warmup = min(warmup, steps - 1)
    if family == "wsd":
        return [{"schedule": "wsd", "value": peak, "warmup_steps": warmup, "decay_steps": max(1, round(fraction * steps)),
                 "decay_shape": shape, "min_ratio": ratio}
                for fraction in DECAY_FRACTIONS if warmup + round(fraction * steps) <= steps
                for shape in SHAPES for ratio in FINAL_RATIOS]  # fmt: skip
    if family == "cosine":
        return [{"schedule": "cosine", "value": peak, "warmup_steps": warmup, "min_ratio": r} for r in FINAL_RATIOS]
    if family == "linear":
        return [{"schedule": "linear", "start": peak, "end": peak * r, "warmup_steps": warmup} for r in FINAL_RATIOS]
    raise ForecastError(f"--family: {family!r} is not one of {list(FAMILIES)}")


def spec_lr(spec: dict[str, Any], steps: int) -> np.ndarray:
    """The lr at every step of an override spec, by the schedules a run uses."""
    from tinker_exp.optim.schedules import compile_schedule

    return compile_schedule(spec, steps, "override.lr").values(np.arange(steps))


def describe_spec(spec: dict[str, Any]) -> str:
    shown = {k: v for k, v in spec.items() if k not in ("schedule", "value", "start")}
    return f"{spec['schedule']} (" + ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items()) + ")"


PROPOSED_NAME = "proposed"
# Settings of the fitted runs a proposed run repeats when they differ from a default run's: the law describes
# that data set and batch size only.
REPEATED_SETTINGS = ("data.path", "data.val_path", "data.val_fraction", "trainer.batch_size", "trainer.eval_every")


def write_proposed(spec: dict[str, Any], steps: int, settings: dict[str, Any], header: list[str], out_dir: Path) -> Path:
    """Write DIR/override/proposed.yaml, a global-package override file of the proposed schedule.

    It runs as is with `--config-dir DIR +override=proposed`: the lr schedule, trainer.steps, and the fitted runs' data
    and batch settings that differ from a default run's."""
    import yaml
    from omegaconf import OmegaConf

    default = OmegaConf.to_container(OmegaConf.structured(compose_config([])))
    doc: dict[str, Any] = {"override": {"lr": spec}, "trainer": {"steps": steps}}
    for key in REPEATED_SETTINGS:
        group, name = key.split(".")
        if key in settings and settings[key] != default.get(group, {}).get(name):
            doc.setdefault(group, {})[name] = settings[key]
    path = out_dir / "override" / f"{PROPOSED_NAME}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    comments = "".join(f"# {line}\n" for line in header)
    path.write_text(f"# @package _global_\n{comments}" + yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path
