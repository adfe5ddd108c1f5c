"""Per-step schedules: small pure functions of (step, total_steps, params) -> value.

Step 0 is the first optimizer step; a schedule over ``total_steps`` covers steps 0 .. total_steps - 1.
``total_steps`` defaults to the run's ``trainer.steps``. Multiplier schedules scale ``value`` (the peak / base
value, e.g. the peak lr); ``linear`` and ``keyframes`` give absolute values. Formulas follow the well-known
references, which the tests check at many steps:

| kind | parameters | value at step s (w = warmup_steps, T = total_steps) | reference |
|---|---|---|---|
| constant | value | value | - |
| linear | start, end, warmup_steps | s < w: start * s / w; else start + (end - start) * (s - w) / (T - w) | HF get_linear_schedule_with_warmup (end = 0) |
| cosine | value, warmup_steps, min_ratio, num_cycles | s < w: value * s / w; else value * (m + (1 - m) * 0.5 * (1 + cos(2 pi c p))), p = (s - w) / (T - w) | HF get_cosine_with_min_lr_schedule_with_warmup, verl get_cosine_schedule_with_warmup |
| cosine_restarts | value, warmup_steps, num_cycles | s < w: warmup; else value * 0.5 * (1 + cos(pi * ((c p) mod 1))), 0 once p >= 1 | HF get_cosine_with_hard_restarts_schedule_with_warmup |
| wsd | value, warmup_steps, decay_steps, [stable_steps], decay_shape, min_ratio, warmup_shape | warmup, hold value, decay (linear / cosine / 1-sqrt) to min_ratio * value | HF get_wsd_schedule, torchtitan's WSD |
| step | value, step_size, gamma | value * gamma ** (s // step_size) | torch StepLR |
| multistep | value, milestones, gamma | value * gamma ** (number of milestones <= s) | torch MultiStepLR |
| exponential | value, gamma | value * gamma ** s | torch ExponentialLR |
| inverse_sqrt | value, warmup_steps, [timescale] | s < w: warmup; else value / sqrt((s + timescale - w) / timescale) | HF get_inverse_sqrt_schedule |
| polynomial | value, end, warmup_steps, power | s < w: warmup; s > T: end; else (value - end) * (1 - (s - w) / (T - w)) ** power + end | HF get_polynomial_decay_schedule_with_warmup |
| keyframes | points {step: value} | piecewise linear between points, constant before the first and after the last | - |

Pure Python: no torch, verl or ray.
"""

from __future__ import annotations

import bisect
import inspect
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tinker_exp.errors import ConfigError
from tinker_exp.optim.convert import number


def _warmup(step: int, warmup_steps: int) -> float:
    return step / max(1, warmup_steps)


def constant(step: int, total: int, *, value: float) -> float:
    return value


def linear(step: int, total: int, *, start: float, end: float, warmup_steps: int = 0) -> float:
    if step < warmup_steps:
        return start * _warmup(step, warmup_steps)
    return start + (end - start) * min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))


def cosine(
    step: int, total: int, *, value: float, warmup_steps: int = 0, min_ratio: float = 0.0, num_cycles: float = 0.5
) -> float:
    if step < warmup_steps:
        return value * _warmup(step, warmup_steps)
    progress = (step - warmup_steps) / max(1, total - warmup_steps)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return value * max(0.0, min_ratio + (1.0 - min_ratio) * factor)


def cosine_restarts(step: int, total: int, *, value: float, warmup_steps: int = 0, num_cycles: int = 1) -> float:
    if step < warmup_steps:
        return value * _warmup(step, warmup_steps)
    progress = (step - warmup_steps) / max(1, total - warmup_steps)
    if progress >= 1.0:
        return 0.0
    return value * max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0))))


_SHAPES = ("linear", "cosine", "1-sqrt")


def wsd(
    step: int,
    total: int,
    *,
    value: float,
    warmup_steps: int,
    decay_steps: int,
    stable_steps: int | None = None,
    decay_shape: str = "cosine",
    warmup_shape: str = "linear",
    min_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> float:
    stable = total - warmup_steps - decay_steps if stable_steps is None else stable_steps

    def shaped(progress: float, shape: str, rising: bool) -> float:
        if shape == "linear":
            factor = progress if rising else 1.0 - progress
        elif shape == "cosine":
            factor = 0.5 * (1.0 - math.cos(math.pi * progress)) if rising else 0.5 * (
                1.0 + math.cos(math.pi * 2.0 * num_cycles * progress)
            )
        else:  # 1-sqrt
            factor = 1.0 - math.sqrt(1.0 - progress) if rising else 1.0 - math.sqrt(progress)
        return value * max(0.0, factor * (1.0 - min_ratio) + min_ratio)

    if step < warmup_steps:
        return shaped(_warmup(step, warmup_steps), warmup_shape, rising=True)
    if step < warmup_steps + stable:
        return value
    if step < warmup_steps + stable + decay_steps:
        return shaped((step - warmup_steps - stable) / max(1, decay_steps), decay_shape, rising=False)
    return value * min_ratio


def step_decay(step: int, total: int, *, value: float, step_size: int, gamma: float = 0.1) -> float:
    return value * gamma ** (step // step_size)


def multistep(step: int, total: int, *, value: float, milestones: list[int], gamma: float = 0.1) -> float:
    return value * gamma ** bisect.bisect_right(sorted(milestones), step)


def exponential(step: int, total: int, *, value: float, gamma: float) -> float:
    return value * gamma**step


def inverse_sqrt(step: int, total: int, *, value: float, warmup_steps: int = 0, timescale: int | None = None) -> float:
    timescale = timescale or warmup_steps or 10_000
    if step < warmup_steps:
        return value * _warmup(step, warmup_steps)
    return value / math.sqrt((step + timescale - warmup_steps) / timescale)


def polynomial(
    step: int, total: int, *, value: float, end: float = 1e-7, warmup_steps: int = 0, power: float = 1.0
) -> float:
    if step < warmup_steps:
        return value * _warmup(step, warmup_steps)
    if step >= total:  # HF has `>`; at step == total both give `end`, and this never divides by zero
        return end
    remaining = 1.0 - (step - warmup_steps) / (total - warmup_steps)
    return (value - end) * remaining**power + end


def keyframes(step: int, total: int, *, points: Mapping[int, float]) -> float:
    xs = sorted(points)
    if step <= xs[0]:
        return points[xs[0]]
    if step >= xs[-1]:
        return points[xs[-1]]
    i = bisect.bisect_right(xs, step)
    x0, x1 = xs[i - 1], xs[i]
    return points[x0] + (points[x1] - points[x0]) * (step - x0) / (x1 - x0)


SCHEDULES: dict[str, Callable[..., float]] = {
    "constant": constant,
    "linear": linear,
    "cosine": cosine,
    "cosine_restarts": cosine_restarts,
    "wsd": wsd,
    "step": step_decay,
    "multistep": multistep,
    "exponential": exponential,
    "inverse_sqrt": inverse_sqrt,
    "polynomial": polynomial,
    "keyframes": keyframes,
}


@dataclass(frozen=True)
class Param:
    """A schedule parameter's type and range: converted and checked like plain override values."""

    kind: str  # "number", "int", "choice", "steps" (a list of step numbers), "points" ({step: number})
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is excluded
    choices: tuple[str, ...] = ()

    def convert(self, value: Any, where: str) -> Any:
        if self.kind == "number":
            converted = number(value, where)
        elif self.kind == "int":
            converted = _integer(value, where)
        elif self.kind == "choice":
            if value not in self.choices:
                raise ConfigError(f"{where}: {value!r} is not one of {list(self.choices)}")
            return value
        elif self.kind == "steps":
            if isinstance(value, (str, Mapping)) or not isinstance(value, (list, tuple)):
                raise ConfigError(f"{where}: expected a list of steps, got {value!r}")
            return [_integer(item, f"{where}[{i}]", low=0) for i, item in enumerate(value)]
        else:  # points
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}: expected a mapping {{step: value}}, got {value!r}")
            steps = [_integer(_int_key(key, where), f"{where}", low=0) for key in value]
            return {step: number(item, f"{where}[{step}]") for step, item in zip(steps, value.values())}
        self._check_range(converted, value, where)
        return converted

    def _check_range(self, converted: float, value: Any, where: str) -> None:
        low_ok = self.low is None or (converted > self.low if self.low_open else converted >= self.low)
        high_ok = self.high is None or converted <= self.high
        if low_ok and high_ok:
            return
        if self.high is None:
            raise ConfigError(f"{where}: must be {'>' if self.low_open else '>='} {self.low:g}, got {value!r}")
        raise ConfigError(f"{where}: {value!r} is not in [{self.low:g}, {self.high:g}]")


def _integer(value: Any, where: str, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if low is not None and value < low:
        raise ConfigError(f"{where}: must be >= {low}, got {value!r}")
    return value


def _int_key(key: Any, where: str) -> int:
    """Keyframe steps: YAML/CLI may give them as int or as digit strings."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    if isinstance(key, bool) or not isinstance(key, int):
        raise ConfigError(f"{where}: keyframe steps must be integers, got {key!r}")
    return key


NUMBER = Param("number")  # the value itself: its range is the override key's, checked at every step
STEPS = Param("int", low=0)
RATIO = Param("number", low=0.0, high=1.0)
POSITIVE = Param("number", low=0.0, low_open=True)
SHAPE = Param("choice", choices=_SHAPES)

PARAMS: dict[str, dict[str, Param]] = {
    "constant": {"value": NUMBER},
    "linear": {"start": NUMBER, "end": NUMBER, "warmup_steps": STEPS},
    "cosine": {"value": NUMBER, "warmup_steps": STEPS, "min_ratio": RATIO, "num_cycles": POSITIVE},
    "cosine_restarts": {"value": NUMBER, "warmup_steps": STEPS, "num_cycles": Param("int", low=1)},
    "wsd": {
        "value": NUMBER, "warmup_steps": STEPS, "decay_steps": STEPS, "stable_steps": STEPS, "decay_shape": SHAPE,
        "warmup_shape": SHAPE, "min_ratio": RATIO, "num_cycles": POSITIVE,
    },  # fmt: skip
    "step": {"value": NUMBER, "step_size": Param("int", low=1), "gamma": POSITIVE},
    "multistep": {"value": NUMBER, "milestones": Param("steps"), "gamma": POSITIVE},
    "exponential": {"value": NUMBER, "gamma": POSITIVE},
    "inverse_sqrt": {"value": NUMBER, "warmup_steps": STEPS, "timescale": Param("int", low=1)},
    "polynomial": {"value": NUMBER, "end": NUMBER, "warmup_steps": STEPS, "power": POSITIVE},
    "keyframes": {"points": Param("points")},
}
"""Each schedule's parameters, typed and ranged (their defaults are the functions' keyword defaults)."""
TOTAL_STEPS = Param("int", low=1)


def _check_consistency(kind: str, params: dict[str, Any], total: int, where: str) -> None:
    """Parameters that cannot describe a sensible plan for this run are errors, not surprises."""
    warmup = params.get("warmup_steps") or 0
    if warmup > total:
        raise ConfigError(f"{where}.warmup_steps: {warmup} is longer than the schedule ({total} steps)")
    if kind == "wsd":
        decay, stable = params["decay_steps"], params.get("stable_steps")
        used = warmup + decay + (stable or 0)
        if used > total:
            raise ConfigError(
                f"{where}: warmup_steps + stable_steps + decay_steps = {used} runs past the end ({total} steps)"
            )
    if kind == "multistep":
        milestones = list(params["milestones"])
        if milestones != sorted(milestones) or len(set(milestones)) != len(milestones):
            raise ConfigError(f"{where}.milestones: must be strictly increasing, got {milestones}")
    if kind == "keyframes":
        steps = list(params["points"])
        if not steps:
            raise ConfigError(f"{where}.points: needs at least one {{step: value}}")
        if steps != sorted(steps) or len(set(steps)) != len(steps):
            raise ConfigError(f"{where}.points: keyframes out of order: steps {steps}")
        if steps[-1] > total:
            raise ConfigError(f"{where}.points: keyframe at step {steps[-1]} is past the end ({total} steps)")


@dataclass(frozen=True)
class Schedule:
    kind: str
    total_steps: int
    function: Callable[[int], float]
    boundaries: tuple[int, ...]  # steps where a phase starts (warmup end, decay start, milestones, ...)
    where: str = "override"  # its config key, named in errors
    params: Mapping[str, Any] = field(default_factory=dict)  # every parameter of its kind, converted, defaults filled in

    def __call__(self, step: int) -> float:
        try:
            return self.function(step)
        except ArithmeticError as e:  # overflow, division by zero: parameters that cannot make a plan
            raise ConfigError(f"{self.where} at step {step} ({self.kind}): cannot be computed ({e})") from None


def _boundaries(kind: str, params: dict[str, Any], total: int) -> tuple[int, ...]:
    warmup = params.get("warmup_steps") or 0
    steps = {warmup} if warmup else set()
    if kind == "wsd":
        stable = params.get("stable_steps")
        stable = total - warmup - params["decay_steps"] if stable is None else stable
        steps |= {warmup + stable, warmup + stable + params["decay_steps"]}
    elif kind == "multistep":
        steps |= set(params["milestones"])
    elif kind == "step":
        steps |= set(range(params["step_size"], total, params["step_size"])[:20])
    elif kind == "keyframes":
        steps |= set(params["points"])
    return tuple(sorted(step for step in steps if 0 < step < total))


def compile_schedule(spec: Mapping[str, Any], run_steps: int, where: str) -> Schedule:
    """A schedule mapping from the config -> a step -> value function; parameters converted and checked up front."""
    spec = dict(spec)
    kind = spec.pop("schedule", None)
    if not isinstance(kind, str) or kind not in SCHEDULES:
        raise ConfigError(f"{where}.schedule: {kind!r} is not one of {sorted(SCHEDULES)} (a schedule needs `schedule:`)")
    total = run_steps
    if spec.get("total_steps") is not None:
        total = TOTAL_STEPS.convert(spec["total_steps"], f"{where}.total_steps")
    spec.pop("total_steps", None)
    function, declared = SCHEDULES[kind], PARAMS[kind]
    # `+override=[lr_wsd,lr_cosine]` merges the two `lr` mappings key by key; the later file's schedule wins,
    # and parameters only the earlier kind takes are dropped (said aloud). Unknown names still fail below.
    leftovers = sorted(set(spec) - set(declared) & set().union(*PARAMS.values()))
    if leftovers:
        warnings.warn(f"{where}: ignoring {leftovers}, not parameters of {kind} (left from an earlier override file?)", stacklevel=2)
        spec = {k: v for k, v in spec.items() if k not in leftovers}
    unknown = sorted(set(spec) - set(declared))
    if unknown:
        raise ConfigError(f"{where} ({kind}): unknown parameter(s) {unknown}; {kind} takes {sorted(declared)}")
    spec = {name: declared[name].convert(value, f"{where}.{name}") for name, value in spec.items() if value is not None}
    missing = sorted(name for name in _required(kind) if name not in spec)
    if missing:
        raise ConfigError(f"{where} ({kind}): missing parameter(s) {missing}")
    _check_consistency(kind, spec, total, where)
    defaults = _defaults(kind)
    params = {name: spec.get(name, defaults.get(name)) for name in declared if name in spec or name in defaults}
    return Schedule(kind, total, lambda step: function(step, total, **spec), _boundaries(kind, spec, total), where, params)


def _defaults(kind: str) -> dict[str, Any]:
    parameters = inspect.signature(SCHEDULES[kind]).parameters.values()
    return {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is not p.empty}


def _required(kind: str) -> list[str]:
    parameters = inspect.signature(SCHEDULES[kind]).parameters.values()
    return [p.name for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
