"""The per-step override plan: every step's values as arrays, converted and checked before any worker starts.

numpy only: no torch, verl or ray. The whole plan is generated and checked up front, so a bad value never costs
a Ray start-up; every schedule is evaluated over all steps at once and its values checked at once (finite, in
range), so a 1,000,000-step plan costs a fraction of a second. Step 0 is the first optimizer step. A value is a
pure function of (config, step), so a resumed run continues exactly where it left off.

An override key is a constant (``lr: 3e-4``) or a schedule mapping (``lr: {schedule: cosine, value: 3e-4,
warmup_steps: 100}``, see ``tinker_exp.optim.schedules``); betas take a list whose two components are each a
constant or a schedule (``betas: [0.9, {schedule: linear, start: 0.95, end: 0.999}]``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinker_exp.errors import ConfigError
from tinker_exp.optim.convert import (
    FLAT_NAMES,
    OVERRIDE_KEYS,
    RANGES,
    betas_pair,
    check_like_verl,
    convert_value,
    nested_values,
    number,
    override_mapping,
)
from tinker_exp.optim.optimizers import PAIR, WORKER_KEYS, OptimizerSpec, sendable_message, spec_of
from tinker_exp.optim.schedules import Schedule, compile_schedule

Column = float | np.ndarray
"""One value's plan: a constant (a builtin float) or its value at every step (float64, one entry per step)."""


@dataclass(frozen=True)
class Plan:
    """What is sent with each ``optimizer_step``: one column per value sent, by its flat name.

    The names: lr, beta1, beta2, eps, weight_decay. No column: nothing sent (``plan[step]`` is ``{}``).

    A step's ``OptimStepParams`` is built when it is needed (``plan[step]``) from builtin floats and tuples only:
    verl's check takes a numpy float64 where a float belongs (a float subclass), the param group then holds a
    float64, and every later plain-float override is rejected."""

    length: int
    columns: Mapping[str, Column]
    optimizer_values: dict[str, Any]  # the values the worker's optimizer is built from
    schedules: dict[str, Schedule] = field(default_factory=dict)  # "lr", "betas[1]", ... -> its schedule
    optimizer: str = "AdamW"  # optimizer.name: which keys its groups hold (tinker_exp.optim.optimizers)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, step: int) -> dict[str, Any]:
        if not 0 <= step < self.length:
            raise IndexError(f"step {step} is not in the plan (0 .. {self.length - 1})")
        flat = {name: float(c if isinstance(c, float) else c[step]) for name, c in self.columns.items()}  # builtin
        return nested_values(flat)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[step] for step in range(self.length))

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for key in OVERRIDE_KEYS if FLAT_NAMES[key][0] in self.columns)

    def column(self, name: str) -> np.ndarray:
        """Every step's value of one column (a read-only view for a constant: no copy)."""
        column = self.columns[name]
        return np.broadcast_to(np.float64(column), (self.length,)) if isinstance(column, float) else column

    def boundaries(self) -> list[int]:
        """Phase starts of every schedule, within the run."""
        return sorted({b for s in self.schedules.values() for b in s.boundaries if b < self.length})


MUON_FIELDS = {"muon_momentum": "momentum", "muon_eps": "eps"}
"""Muon's own float fields -> the key whose range they share."""


def optimizer_values(optimizer_cfg: Any) -> dict[str, Any]:
    """The values the optimizer's constructor is given (its spec's built_with).

    Floats and tuples converted and range-checked like overrides; flags, counts and names as the typed schema holds
    them.

    The worker builds the optimizer from this dict, so its param groups hold these types and verl's check at
    the worker agrees with ours.
    """
    spec = spec_of(_name(optimizer_cfg))
    values: dict[str, Any] = {}
    for key in spec.built_with:
        raw = getattr(optimizer_cfg, key)
        if key in MUON_FIELDS:
            values[key] = number(raw, f"optimizer.{key}")
            RANGES[MUON_FIELDS[key]].check(values[key], raw, f"optimizer.{key}")
        elif key in RANGES:
            values[key] = convert_value(key, raw, "optimizer")
        else:
            values[key] = raw
    return values


def _name(optimizer_cfg: Any) -> str:
    return getattr(optimizer_cfg.name, "value", optimizer_cfg.name)


def group_types(spec: OptimizerSpec) -> dict[str, type]:
    """The types every param group holds for each key an override may send.

    The table's kinds; a worker key is a float, as the worker reads it back."""
    first = spec.parts[next(iter(spec.parts))]
    return {key: tuple if key not in WORKER_KEYS and first.keys[key] == PAIR else float for key in spec.sendable}


def check_sendable(override: Mapping[str, Any], spec: OptimizerSpec) -> None:
    """The seed's rule (a key every group holds, as a float), moved before any worker starts."""
    for key, value in override.items():
        reason = spec.refusal(key) if value is not None else None
        if reason is not None:
            raise ConfigError(f"override.{key}: {reason}; {sendable_message(spec)}")


def verl_names(
    override: Mapping[str, Any], values: Mapping[str, Any], spec: OptimizerSpec
) -> tuple[dict[str, Any], dict[str, str]]:
    """Tinker's AdamParams spellings (learning_rate, beta1, beta2) as verl's lr and betas.

    A beta given alone keeps the optimizer's own other beta. The same value in both spellings is an error. Also returns
    each value's name as the user spelled it (verl's label -> Tinker's: "betas[0]" -> "beta1"), for errors to name it as
    typed."""
    out, spelled = dict(override), {}
    if out.get("learning_rate") is not None:
        if out.get("lr") is not None:
            raise ConfigError("override.learning_rate: lr is set too (one key in two spellings: Tinker's and verl's); keep one")
        out["lr"] = out.pop("learning_rate")
        spelled["lr"] = "learning_rate"
    out.pop("learning_rate", None)
    beta1, beta2 = out.pop("beta1", None), out.pop("beta2", None)
    if beta1 is not None or beta2 is not None:
        name = "beta1" if beta1 is not None else "beta2"
        if out.get("betas") is not None:
            raise ConfigError(f"override.{name}: betas is set too (one key in two spellings: Tinker's and verl's); keep one")
        if "betas" not in values:
            raise ConfigError(f"override.{name} (betas[{int(name == 'beta2')}]): {spec.refusal('betas')}; "
                              f"{sendable_message(spec)}")
        own = values["betas"]
        out["betas"] = [own[0] if beta1 is None else beta1, own[1] if beta2 is None else beta2]
        spelled |= {f"betas[{i}]": f"beta{i + 1}" for i, beta in enumerate((beta1, beta2)) if beta is not None}
    return out, spelled


def _labels(key: str) -> tuple[str, ...]:
    """Each value's name in errors and ``Plan.schedules``: "lr", or "betas[0]" and "betas[1]"."""
    return ("betas[0]", "betas[1]") if key == "betas" else (key,)


def _sources(
    override: Mapping[str, Any], run_steps: int, values: Mapping[str, Any], spelled: Mapping[str, str]
) -> dict[str, tuple[str, str, float | Schedule, str]]:
    """Each value sent, by flat name, with where it comes from and what gives it.

    flat name -> (override key, label, a converted and checked constant or a compiled schedule, its name in errors:
    `spelled`'s, as the user typed it). A schedule's peak defaults to the optimizer's value for its key (`values`: lr,
    or betas[i] for a betas component); its parameters that are values of the key are held to the key's range."""
    sources: dict[str, tuple[str, str, float | Schedule, str]] = {}
    for key, spec in override.items():
        if spec is None:
            continue
        if key == "betas" and isinstance(spec, Mapping):
            raise ConfigError("override.betas: schedule each component on its own: [beta1, beta2]")
        items = betas_pair(spec, "override.betas") if key == "betas" else [spec]
        peaks = values[key] if key == "betas" else [values[key]]
        for name, label, item, peak in zip(FLAT_NAMES[key], _labels(key), items, peaks):
            where = f"override.{spelled.get(label, label)}"
            if isinstance(item, Mapping):
                source: float | Schedule = compile_schedule(item, run_steps, where, peak, RANGES[key])
            else:
                source = number(item, where)
                RANGES[key].check(source, item, where)
            sources[name] = (key, label, source, where)
    return sources


def _first_error(columns: dict[str, np.ndarray], sources: dict[str, tuple[str, str, Any, str]]) -> ConfigError | None:
    """The error at the earliest step where any schedule gives a value not finite or not in its key's range.

    Ties: in the order of the keys. It names the key, the step and the schedule; None when there is none."""
    first: tuple[int, str] | None = None
    for name in (name for key in OVERRIDE_KEYS for name in FLAT_NAMES[key] if name in columns):
        key = sources[name][0]
        values = columns[name]
        bad = ~(np.isfinite(values) & RANGES[key].contains(values))
        if bad.any():
            step = int(np.argmax(bad))
            if first is None or step < first[0]:
                first = (step, name)
    if first is None:
        return None
    step, name = first
    key, _, schedule, where = sources[name]
    value = float(columns[name][step])
    where = f"{where} at step {step} ({schedule.kind})"
    if not np.isfinite(value):
        return ConfigError(f"{where}: cannot be computed (it gives {value!r})")
    return RANGES[key].error(value, where)


def build_plan(override_node: Any, optimizer_cfg: Any, total_steps: int) -> Plan:
    """Generate, convert and check the values for every step in [0, total_steps).

    `total_steps` is trainer.steps (>= 1, checked by TrainerConfig)."""
    values = optimizer_values(optimizer_cfg)
    clip = float(optimizer_cfg.clip_grad or 0.0)
    return plan_for(override_mapping(override_node), values, total_steps, _name(optimizer_cfg), clip)


def plan_for(
    override: Mapping[str, Any], values: dict[str, Any], total_steps: int, optimizer: str, clip_grad: float = 0.0
) -> Plan:
    """The plan of an override mapping for an optimizer built from `values`.

    `optimizer` names it in errors; `clip_grad`: the engine's own clip (0: none), a grad_clip_norm schedule's peak
    unless it gives one."""
    spec = spec_of(optimizer)
    override, spelled = verl_names(override, values, spec)
    check_sendable(override, spec)
    sources = _sources(override, total_steps, {**values, "grad_clip_norm": clip_grad}, spelled)
    schedules = {label: s for _, label, s, _ in sources.values() if isinstance(s, Schedule)}
    steps = np.arange(total_steps, dtype=np.int64) if schedules else None
    columns: dict[str, Column] = {}
    for name, (_, _, source, _) in sources.items():
        if isinstance(source, Schedule):
            source = source.values(steps)
            source.flags.writeable = False  # what was checked is what is sent
        columns[name] = source
    error = _first_error({n: c for n, c in columns.items() if isinstance(c, np.ndarray)}, sources)
    if error is not None:
        raise error
    ordered = {name: columns[name] for key in OVERRIDE_KEYS for name in FLAT_NAMES[key] if name in columns}
    plan = Plan(length=total_steps, columns=ordered, optimizer_values=values, schedules=schedules, optimizer=optimizer)
    check_like_verl(plan[0], group_types(spec), optimizer)  # same keys and types at every step
    return plan


def override_config(plan: Plan, fractions: bool = False) -> dict[str, Any]:
    """The override as the plan uses it, one entry per value sent.

    The W&B run config's `override` section, and plan.json's: the plan is rebuilt from it.

    Every key sent maps to its schedule: ``{"schedule": kind, <every parameter of the kind, converted, defaults
    filled in, lengths in steps>, "total_steps": n}``; a plain value is ``{"schedule": "constant", "value": v}`` (a
    constant has no total_steps); betas is a list of two of them. With `fractions`, a schedule given lengths as
    fractions also holds them as given (``"fractions": {"warmup_steps": 0.05}``, plan.json's). Parameters left from
    an earlier composed override file are not in it (the plan dropped them), nor are keys that are not sent.
    """

    def entry(label: str, constant: float) -> dict[str, Any]:
        schedule = plan.schedules.get(label)
        if schedule is None or schedule.kind == "constant":
            return {"schedule": "constant", "value": schedule.params["value"] if schedule else constant}
        given = {"fractions": dict(schedule.fractions)} if fractions and schedule.fractions else {}
        return {"schedule": schedule.kind, **schedule.params, "total_steps": schedule.total_steps, **given}

    config: dict[str, Any] = {}
    first = plan[0]
    for key in plan.keys:
        sent = first[key]
        config[key] = [entry(f"betas[{i}]", sent[i]) for i in range(2)] if key == "betas" else entry(key, sent)
    return config
