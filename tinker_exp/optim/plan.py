"""The per-step override plan: one converted, validated ``OptimStepParams`` per optimizer step.

Pure Python. The whole plan is generated and checked before any worker starts, so a bad value never costs a
Ray start-up. Step 0 is the first optimizer step. A value is a pure function of (config, step), so a resumed
run continues exactly where it left off.

An override key is a constant (``lr: 3e-4``) or a schedule mapping (``lr: {schedule: cosine, value: 3e-4,
warmup_steps: 100}``, see ``tinker_exp.schedules``); betas take a list whose two components are each a
constant or a schedule (``betas: [0.9, {schedule: linear, start: 0.95, end: 0.999}]``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tinker_exp.errors import ConfigError
from tinker_exp.optim.convert import (
    OVERRIDE_KEYS,
    betas_pair,
    check_like_verl,
    convert_params,
    convert_value,
    override_mapping,
    param_group_types,
)
from tinker_exp.optim.schedules import Schedule, compile_schedule


@dataclass(frozen=True)
class Plan:
    """What is sent with each ``optimizer_step``; an empty dict means no override for that step."""

    steps: list[dict[str, Any]]
    optimizer_values: dict[str, Any]  # the values the worker's optimizer is built from
    schedules: dict[str, Schedule] = field(default_factory=dict)  # "lr", "betas[1]", ... -> its schedule

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, step: int) -> dict[str, Any]:
        return self.steps[step]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for key in OVERRIDE_KEYS if any(key in params for params in self.steps))

    def boundaries(self) -> list[int]:
        """Phase starts of every schedule, within the run."""
        return sorted({b for s in self.schedules.values() for b in s.boundaries if b < len(self.steps)})


def optimizer_values(optimizer_cfg: Any) -> dict[str, Any]:
    """The optimizer's own lr/betas/eps/weight_decay as exactly float and tuple.

    The worker builds AdamW from this dict, so its param groups hold these types and verl's check at
    the worker agrees with ours.
    """
    return {key: convert_value(key, getattr(optimizer_cfg, key), "optimizer") for key in OVERRIDE_KEYS}


def _sources(override: Mapping[str, Any], run_steps: int) -> tuple[dict[str, Any], dict[str, Schedule]]:
    """key -> a constant or Schedule (betas: a list of two of them); plus every schedule by its label."""
    sources: dict[str, Any] = {}
    schedules: dict[str, Schedule] = {}
    for key, spec in override.items():
        if spec is None:
            continue
        if key == "betas" and isinstance(spec, Mapping):
            raise ConfigError("override.betas: schedule each component on its own: [beta1, beta2]")
        if key == "betas" and isinstance(spec, Sequence) and any(isinstance(item, Mapping) for item in spec):
            parts = []
            for i, item in enumerate(betas_pair(spec, "override.betas")):
                if isinstance(item, Mapping):
                    item = schedules[f"betas[{i}]"] = compile_schedule(item, run_steps, f"override.betas[{i}]")
                parts.append(item)
            sources[key] = parts
        elif isinstance(spec, Mapping):
            sources[key] = schedules[key] = compile_schedule(spec, run_steps, f"override.{key}")
        else:
            sources[key] = spec
    return sources, schedules


def _value_at(source: Any, step: int) -> Any:
    if isinstance(source, Schedule):
        return source(step)
    if isinstance(source, list):
        return [_value_at(part, step) for part in source]
    return source


def _at_step(error: ConfigError, step: int, schedules: dict[str, Schedule]) -> ConfigError:
    """'override.betas[1]: 1.02 is not in [0, 1)' -> 'override.betas[1] at step 7 (cosine): 1.02 is ...'."""
    path, _, text = str(error).partition(": ")
    label = path.removeprefix("override.")
    schedule = schedules.get(label) or schedules.get(label.split("[")[0])
    if schedule is None:  # a constant: the step says nothing
        return error
    return ConfigError(f"{path} at step {step} ({schedule.kind}): {text}")


def build_plan(override_node: Any, optimizer_cfg: Any, total_steps: int) -> Plan:
    """Generate, convert and check the values for every step in [0, total_steps).

    `total_steps` is trainer.steps (>= 1, checked by TrainerConfig)."""
    values = optimizer_values(optimizer_cfg)
    override = override_mapping(override_node)
    sources, schedules = _sources(override, total_steps)
    optimizer = getattr(optimizer_cfg.name, "value", optimizer_cfg.name)

    if not schedules:  # constants: convert once, send the same dict every step
        params = convert_params(sources)
        check_like_verl(params, param_group_types(values), optimizer)
        return Plan(steps=[params] * total_steps, optimizer_values=values)

    steps = []
    for step in range(total_steps):
        try:
            steps.append(convert_params({key: _value_at(source, step) for key, source in sources.items()}))
        except ConfigError as e:
            raise _at_step(e, step, schedules) from None
    check_like_verl(steps[0], param_group_types(values), optimizer)  # same keys and types at every step
    return Plan(steps=steps, optimizer_values=values, schedules=schedules)


def override_config(plan: Plan) -> dict[str, Any]:
    """The override as the plan uses it, one entry per value sent (the W&B run config's `override` section).

    Every key sent maps to its schedule: ``{"schedule": kind, <every parameter of the kind, converted, defaults
    filled in>, "total_steps": n}``; a plain value is ``{"schedule": "constant", "value": v}`` (a constant has no
    total_steps); betas is a list of two of them. Parameters left from an earlier composed override file are
    not in it (the plan dropped them), nor are keys that are not sent.
    """

    def entry(label: str, constant: float) -> dict[str, Any]:
        schedule = plan.schedules.get(label)
        if schedule is None or schedule.kind == "constant":
            return {"schedule": "constant", "value": schedule.params["value"] if schedule else constant}
        return {"schedule": schedule.kind, **schedule.params, "total_steps": schedule.total_steps}

    config: dict[str, Any] = {}
    for key in plan.keys:
        sent = plan[0][key]
        config[key] = [entry(f"betas[{i}]", sent[i]) for i in range(2)] if key == "betas" else entry(key, sent)
    return config
