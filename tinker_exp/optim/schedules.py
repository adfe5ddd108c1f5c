"""Per-step schedules: small pure functions of (steps, total_steps, params) -> values, over every step at once.

Step 0 is the first optimizer step; a schedule over ``total_steps`` covers steps 0 .. total_steps - 1.
``total_steps`` defaults to the run's ``trainer.steps``. Multiplier schedules scale ``value`` (the peak / base
value, e.g. the peak lr); ``linear`` and ``keyframes`` give absolute values.

The peak follows the optimizer: a parameter declared ``PEAK`` below (every kind's ``value``, linear's ``start`` and
``end``) that is not given, or given as null, is the optimizer's own value for that key (``optimizer.lr`` for lr,
``optimizer.betas[1]`` for betas[1], ...). An explicit value wins.

Lengths (``warmup_steps``, ``stable_steps``, ``decay_steps``, ``step_size``, each of ``milestones``, ``timescale``):
an integer is a number of steps; a float is a fraction of the schedule's ``total_steps`` and must be in [0, 1],
resolved to ``floor(fraction * total_steps + 0.5)`` steps (the nearest step, halves up: 0.05 of 20 steps is 1,
of 1,000,000 is 50,000). So ``1`` is one step and ``1.0`` the whole schedule. The resolved count is then checked
like an integer one (a ``step_size`` of 0.01 of 20 steps resolves to 0: an error). The plan, its table, plan.json
and the W&B config show the resolved counts.

After the end (a run longer than ``total_steps``): a kind with an end holds its value at the end of its formula
(step ``total_steps``): constant, linear (``end``), cosine (``value * min_ratio`` for the default half cycle: its
progress is clamped at 1, where HF's formula, never evaluated past its end there, would rise back), cosine_restarts
(0), wsd (``value * min_ratio``), polynomial (``end``), keyframes (the last point), one_cycle (its floor,
``value / div_factor / final_div_factor``), one_cycle_momentum (``max_momentum``). step, multistep, exponential
and inverse_sqrt have no end: they go on by their formula.

Each function takes an integer numpy
array of steps and returns a float64 array: a 1,000,000-step plan is a few array operations, not a million calls.
Most compute each branch for every step and pick the step's own (``np.where``), so branches not taken may overflow
or divide by zero harmlessly (the caller ignores numpy's floating-point warnings and checks what was picked). Formulas follow the well-known references, which the tests check at many steps:

| kind | parameters | value at step s (w = warmup_steps, T = total_steps) | reference |
|---|---|---|---|
| constant | value | value | - |
| linear | start, end, warmup_steps | s < w: start * s / w; else start + (end - start) * (s - w) / (T - w) | HF get_linear_schedule_with_warmup (end = 0) |
| cosine | value, warmup_steps, min_ratio, num_cycles | s < w: value * s / w; else value * (m + (1 - m) * 0.5 * (1 + cos(2 pi c p))), p = min(1, (s - w) / (T - w)) | HF get_cosine_with_min_lr_schedule_with_warmup, verl get_cosine_schedule_with_warmup |
| cosine_restarts | value, warmup_steps, num_cycles | s < w: warmup; else value * 0.5 * (1 + cos(pi * ((c p) mod 1))), 0 once p >= 1 | HF get_cosine_with_hard_restarts_schedule_with_warmup |
| wsd | value, warmup_steps, decay_steps, [stable_steps], decay_shape, min_ratio, warmup_shape | warmup, hold value, decay (linear / cosine / 1-sqrt) to min_ratio * value | HF get_wsd_schedule, torchtitan's WSD |
| step | value, step_size, gamma | value * gamma ** (s // step_size) | torch StepLR |
| multistep | value, milestones, gamma | value * gamma ** (number of milestones <= s) | torch MultiStepLR |
| exponential | value, gamma | value * gamma ** s | torch ExponentialLR |
| inverse_sqrt | value, warmup_steps, [timescale] | s < w: warmup; else value / sqrt((s + timescale - w) / timescale) | HF get_inverse_sqrt_schedule |
| polynomial | value, end, warmup_steps, power | s < w: warmup; s > T: end; else (value - end) * (1 - (s - w) / (T - w)) ** power + end | HF get_polynomial_decay_schedule_with_warmup |
| keyframes | points {step: value} | piecewise linear between points, constant before the first and after the last | - |
| one_cycle | value, pct_start, div_factor, final_div_factor, anneal, three_phase | value / div_factor up to value over pct_start * T steps, then down to value / div_factor / final_div_factor (three_phase: back to value / div_factor first) | torch OneCycleLR |
| one_cycle_momentum | base_momentum, max_momentum, pct_start, anneal, three_phase | one_cycle's inverse: max_momentum (the peak: the optimizer's momentum or beta1) down to base_momentum while the lr rises, then back up | torch OneCycleLR (cycle_momentum) |

numpy only: no torch, verl or ray.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinker_exp.errors import ConfigError, a_or_an
from tinker_exp.optim.convert import Range, number


Steps = np.ndarray  # int64 steps in, float64 values out


def _warmup(step: Steps, warmup_steps: int) -> np.ndarray:
    return step / max(1, warmup_steps)


def constant(step: Steps, total: int, *, value: float) -> np.ndarray:
    return np.full(step.shape, value)


def linear(step: Steps, total: int, *, start: float, end: float, warmup_steps: int = 0) -> np.ndarray:
    ramp = start + (end - start) * np.minimum(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
    return np.where(step < warmup_steps, start * _warmup(step, warmup_steps), ramp)


def cosine(
    step: Steps, total: int, *, value: float, warmup_steps: int = 0, min_ratio: float = 0.0, num_cycles: float = 0.5
) -> np.ndarray:
    progress = np.minimum(1.0, (step - warmup_steps) / max(1, total - warmup_steps))  # past the end: hold the end
    factor = 0.5 * (1.0 + np.cos(np.pi * num_cycles * 2.0 * progress))
    decay = value * np.maximum(0.0, min_ratio + (1.0 - min_ratio) * factor)
    return np.where(step < warmup_steps, value * _warmup(step, warmup_steps), decay)


def cosine_restarts(step: Steps, total: int, *, value: float, warmup_steps: int = 0, num_cycles: int = 1) -> np.ndarray:
    progress = (step - warmup_steps) / max(1, total - warmup_steps)
    cycles = value * np.maximum(0.0, 0.5 * (1.0 + np.cos(np.pi * ((num_cycles * progress) % 1.0))))
    return np.where(step < warmup_steps, value * _warmup(step, warmup_steps), np.where(progress >= 1.0, 0.0, cycles))


_SHAPES = ("linear", "cosine", "1-sqrt")


def wsd(
    step: Steps,
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
) -> np.ndarray:
    stable = total - warmup_steps - decay_steps if stable_steps is None else stable_steps

    def shaped(progress: np.ndarray, shape: str, rising: bool) -> np.ndarray:
        if shape == "linear":
            factor = progress if rising else 1.0 - progress
        elif shape == "cosine":
            factor = 0.5 * (1.0 - np.cos(np.pi * progress)) if rising else 0.5 * (
                1.0 + np.cos(np.pi * 2.0 * num_cycles * progress)
            )
        else:  # 1-sqrt
            factor = 1.0 - np.sqrt(1.0 - progress) if rising else 1.0 - np.sqrt(progress)
        return value * np.maximum(0.0, factor * (1.0 - min_ratio) + min_ratio)

    decay_start = warmup_steps + stable
    values = np.full(step.shape, value * min_ratio)
    values[step < decay_start + decay_steps] = value
    # The shaped phases are short next to a long stable one: computed at their own steps only.
    warm = step < warmup_steps
    values[warm] = shaped(_warmup(step[warm], warmup_steps), warmup_shape, rising=True)
    decay = (step >= decay_start) & (step < decay_start + decay_steps)
    values[decay] = shaped((step[decay] - warmup_steps - stable) / max(1, decay_steps), decay_shape, rising=False)
    return values


def step_decay(step: Steps, total: int, *, value: float, step_size: int, gamma: float = 0.1) -> np.ndarray:
    return value * gamma ** (step // step_size)


def multistep(step: Steps, total: int, *, value: float, milestones: list[int], gamma: float = 0.1) -> np.ndarray:
    passed = np.searchsorted(np.array(sorted(milestones), dtype=np.int64), step, side="right")  # milestones <= step
    return value * gamma ** passed


def exponential(step: Steps, total: int, *, value: float, gamma: float) -> np.ndarray:
    return value * gamma**step


def inverse_sqrt(step: Steps, total: int, *, value: float, warmup_steps: int = 0, timescale: int | None = None) -> np.ndarray:
    timescale = timescale or warmup_steps or 10_000
    decay = value / np.sqrt((step + timescale - warmup_steps) / timescale)
    return np.where(step < warmup_steps, value * _warmup(step, warmup_steps), decay)


def polynomial(
    step: Steps, total: int, *, value: float, end: float = 1e-7, warmup_steps: int = 0, power: float = 1.0
) -> np.ndarray:
    # HF has `step > total: end`; at step == total both give `end`. The divisor only differs (1) where a warmup
    # fills the schedule, and there every step is warmup or end.
    remaining = 1.0 - (step - warmup_steps) / max(1, total - warmup_steps)
    decay = (value - end) * remaining**power + end
    return np.where(step < warmup_steps, value * _warmup(step, warmup_steps), np.where(step >= total, end, decay))


def keyframes(step: Steps, total: int, *, points: Mapping[int, float]) -> np.ndarray:
    xs = np.array(sorted(points), dtype=np.int64)
    ys = np.array([points[x] for x in sorted(points)], dtype=np.float64)
    if len(xs) == 1:
        return np.full(step.shape, ys[0])
    right = np.clip(np.searchsorted(xs, step, side="right"), 1, len(xs) - 1)
    x0, x1, y0, y1 = xs[right - 1], xs[right], ys[right - 1], ys[right]
    between = y0 + (y1 - y0) * (step - x0) / (x1 - x0)
    return np.where(step <= xs[0], ys[0], np.where(step >= xs[-1], ys[-1], between))


def _one_cycle_phases(step: Steps, total: int, starts_ends: list[tuple[float, float]], pct_start: float,
                      anneal: str, three_phase: bool) -> np.ndarray:
    """The values of torch's OneCycleLR at each step.

    Phase i runs from the previous end step to its own end step (pct_start * T - 1, then 2 * pct_start * T - 2 in three
    phases, then T - 1), annealing from its start to its end value."""
    ends = [pct_start * total - 1, 2 * pct_start * total - 2, total - 1] if three_phase else [pct_start * total - 1, total - 1]
    values = np.empty(step.shape)
    done = np.zeros(step.shape, dtype=bool)
    begin = 0.0
    for index, (end, (start_value, end_value)) in enumerate(zip(ends, starts_ends)):
        here = ~done & ((step <= end) | (index == len(ends) - 1))
        with np.errstate(all="ignore"):  # past the last phase's end (step T - 1) it holds its end value
            pct = np.minimum(1.0, (step[here] - begin) / (end - begin))
        if anneal == "cosine":
            values[here] = end_value + (start_value - end_value) / 2.0 * (np.cos(np.pi * pct) + 1)
        else:
            values[here] = (end_value - start_value) * pct + start_value
        done |= here
        begin = end
    return values


def one_cycle(step: Steps, total: int, *, value: float, pct_start: float = 0.3, div_factor: float = 25.0,
              final_div_factor: float = 1e4, anneal: str = "cosine", three_phase: bool = False) -> np.ndarray:
    initial = value / div_factor
    low = initial / final_div_factor
    phases = [(initial, value), (value, initial), (initial, low)] if three_phase else [(initial, value), (value, low)]
    return _one_cycle_phases(step, total, phases, pct_start, anneal, three_phase)


def one_cycle_momentum(step: Steps, total: int, *, base_momentum: float = 0.85, max_momentum: float = 0.95,
                       pct_start: float = 0.3, anneal: str = "cosine", three_phase: bool = False) -> np.ndarray:
    phases = [(max_momentum, base_momentum), (base_momentum, max_momentum)]
    phases += [(max_momentum, max_momentum)] if three_phase else []
    return _one_cycle_phases(step, total, phases, pct_start, anneal, three_phase)


SCHEDULES: dict[str, Callable[..., np.ndarray]] = {
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
    "one_cycle": one_cycle,
    "one_cycle_momentum": one_cycle_momentum,
}


@dataclass(frozen=True)
class Param:
    """A schedule parameter's type and range: converted and checked like plain override values."""

    kind: str  # "number", "int", "length", "choice", "lengths" (a list of lengths), "points" ({step: number})
    range: Range = Range()
    choices: tuple[str, ...] = ()
    peak: bool = False  # not given (or null): the optimizer's own value for the key (see the module's docstring)
    of_key: bool = False  # a value the key itself takes (a peak, an end, keyframes' values): in the key's range

    def convert(self, value: Any, where: str, total: int, key_range: Range | None = None) -> Any:
        """The converted value; a length (or each of lengths) resolved to steps of a `total`-step schedule.

        A value of the key is held to `key_range` (the override key's: a negative peak lr is named here, as given, not
        at the first step it reaches)."""
        if self.kind == "number":
            converted = number(value, where)
            if self.of_key and key_range is not None:
                key_range.check(converted, value, where)
        elif self.kind == "int":
            converted = _integer(value, where)
        elif self.kind == "length":
            return _length(value, where, total, self.range.low)
        elif self.kind == "choice":
            if value not in self.choices or isinstance(value, bool) != isinstance(self.choices[0], bool):
                from tinker_exp.errors import suggest

                word = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731 (YAML's words)
                known = [word(choice) for choice in self.choices]
                raise ConfigError(f"{where}: {word(value)} is not a choice" + suggest(word(value), known, "choices:"))
            return value
        elif self.kind == "lengths":
            if isinstance(value, (str, Mapping)) or not isinstance(value, (list, tuple)):
                raise ConfigError(f"{where}: expected a list of steps, got {value!r}")
            return [_length(item, f"{where}[{i}]", total, 0) for i, item in enumerate(value)]
        else:  # points
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}: expected a mapping {{step: value}}, got {value!r}")
            steps = [_integer(_int_key(key, where), f"{where}", low=0) for key in value]
            points = {step: number(item, f"{where}[{step}]") for step, item in zip(steps, value.values())}
            for (step, converted), item in zip(points.items(), value.values()):
                if self.of_key and key_range is not None:
                    key_range.check(converted, item, f"{where}[{step}]")
            return points
        self.range.check(converted, value, where)
        return converted

    def fraction_given(self, value: Any) -> bool:
        """Whether `value` holds a length given as a fraction (plan.json keeps it beside the resolved steps)."""
        items = value if self.kind == "lengths" and isinstance(value, (list, tuple)) else [value]
        return self.kind in ("length", "lengths") and any(isinstance(item, float) for item in items)


MAX_INT = 2**53
"""Steps and counts are computed as int64 and float64: a larger one is beyond any plan (and would overflow)."""


def _integer(value: Any, where: str, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if low is not None and value < low:
        raise ConfigError(f"{where}: must be >= {low}, got {value!r}")
    if abs(value) > MAX_INT:
        raise ConfigError(f"{where}: {value!r} is too large (at most 2**53)")
    return value


def _length(value: Any, where: str, total: int, low: float | None) -> int:
    """A length in steps: an integer as given, a float as that fraction of the schedule (the rule: module docstring)."""
    if isinstance(value, float):
        if not 0.0 <= value <= 1.0:  # nan too
            raise ConfigError(
                f"{where}: {value!r} is not in [0, 1]: a float is a fraction of the schedule ({total} steps), "
                "an integer a number of steps"
            )
        steps = math.floor(value * total + 0.5)
        if low is not None and steps < low:
            raise ConfigError(f"{where}: {value!r} of the schedule ({total} steps) is {steps} steps; must be >= {low:g}")
        return steps
    return _integer(value, where, low=None if low is None else int(low))


def _int_key(key: Any, where: str) -> int:
    """Keyframe steps: YAML/CLI may give them as int or as digit strings."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    if isinstance(key, bool) or not isinstance(key, int):
        raise ConfigError(f"{where}: keyframe steps must be integers, got {key!r}")
    return key


NUMBER = Param("number", of_key=True)  # a value of the key itself: in its range (and every step's value is checked)
PEAK = Param("number", peak=True, of_key=True)  # a value of the key that defaults to the optimizer's
STEPS = Param("length", Range(low=0))
RATIO = Param("number", Range(0.0, 1.0))
POSITIVE = Param("number", Range(low=0.0, low_open=True))
COUNT = Param("int", Range(low=1))
LENGTH = Param("length", Range(low=1))  # a length of at least one step
SHAPE = Param("choice", choices=_SHAPES)

PARAMS: dict[str, dict[str, Param]] = {
    "constant": {"value": PEAK},
    "linear": {"start": PEAK, "end": PEAK, "warmup_steps": STEPS},
    "cosine": {"value": PEAK, "warmup_steps": STEPS, "min_ratio": RATIO, "num_cycles": POSITIVE},
    "cosine_restarts": {"value": PEAK, "warmup_steps": STEPS, "num_cycles": COUNT},
    "wsd": {
        "value": PEAK, "warmup_steps": STEPS, "decay_steps": STEPS, "stable_steps": STEPS, "decay_shape": SHAPE,
        "warmup_shape": SHAPE, "min_ratio": RATIO, "num_cycles": POSITIVE,
    },  # fmt: skip
    "step": {"value": PEAK, "step_size": LENGTH, "gamma": POSITIVE},
    "multistep": {"value": PEAK, "milestones": Param("lengths"), "gamma": POSITIVE},
    "exponential": {"value": PEAK, "gamma": POSITIVE},
    "inverse_sqrt": {"value": PEAK, "warmup_steps": STEPS, "timescale": LENGTH},
    "polynomial": {"value": PEAK, "end": NUMBER, "warmup_steps": STEPS, "power": POSITIVE},
    "keyframes": {"points": Param("points", of_key=True)},
    "one_cycle": {
        "value": PEAK, "pct_start": Param("number", Range(0.0, 1.0, low_open=True, high_open=True)),
        "div_factor": POSITIVE, "final_div_factor": POSITIVE, "anneal": Param("choice", choices=("cosine", "linear")),
        "three_phase": Param("choice", choices=(False, True)),
    },  # fmt: skip
    "one_cycle_momentum": {
        "base_momentum": NUMBER, "max_momentum": PEAK,
        "pct_start": Param("number", Range(0.0, 1.0, low_open=True, high_open=True)),
        "anneal": Param("choice", choices=("cosine", "linear")), "three_phase": Param("choice", choices=(False, True)),
    },  # fmt: skip
}
"""Each schedule's parameters, typed and ranged (their defaults are the functions' keyword defaults)."""
TOTAL_STEPS = COUNT


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
    if kind == "one_cycle_momentum":
        given = {**_defaults(kind), **params}
        if given["max_momentum"] < given["base_momentum"]:  # e.g. RMSprop's default momentum 0 as the peak
            warnings.warn(  # torch's OneCycleLR allows it too; it is rarely meant
                f"{where}.max_momentum: {given['max_momentum']} is below base_momentum {given['base_momentum']}: "
                "the cycle rises while the lr rises (set max_momentum, or the optimizer's momentum it defaults to)",
                stacklevel=2,
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


def _warn_vanished_phases(kind: str, params: dict[str, Any], fractions: Mapping[str, Any], total: int, where: str) -> None:
    """Warn once about phases given as fractions that a short schedule rounds away.

    E.g. `+override=lr_wsd trainer.steps=4`: no warmup, a 1-step decay. The run is valid, and not what the preset
    describes. A decay reaches its floor at step total_steps, one past the last step run, so a 1-step decay never lowers
    the value."""
    notes = []
    for name, given in fractions.items():
        if name not in ("warmup_steps", "stable_steps", "decay_steps") or not given:
            continue
        steps, phase = params[name], name.removesuffix("_steps")
        if steps == 0:
            notes.append(f"{name}={given:g} rounds to 0 steps (no {phase})")
        elif name == "decay_steps" and steps == 1 and kind == "wsd":
            notes.append(
                f"{name}={given:g} to 1 step (a decay reaches its floor at step {total}, one past the last step run: "
                "this one never lowers the value)"
            )
    if notes:
        warnings.warn(f"{where}: in {a_or_an(f'{total}-step')} schedule, {' and '.join(notes)}", stacklevel=3)


@dataclass(frozen=True)
class Schedule:
    kind: str
    total_steps: int
    function: Callable[[np.ndarray], np.ndarray]  # int64 steps -> float64 values
    boundaries: tuple[int, ...]  # steps where a phase starts (warmup end, decay start, milestones, ...)
    where: str = "override"  # its config key, named in errors
    params: Mapping[str, Any] = field(default_factory=dict)  # every parameter of its kind, converted, defaults filled in
    fractions: Mapping[str, Any] = field(default_factory=dict)  # lengths given as fractions, as given (resolved in params)

    def values(self, steps: np.ndarray) -> np.ndarray:
        """The value at each step (float64), unchecked.

        inf or nan where the parameters overflow (the plan reports the first such step)."""
        with np.errstate(all="ignore"):  # branches not taken may overflow; what is taken is checked by the plan
            return np.asarray(self.function(np.asarray(steps, dtype=np.int64)), dtype=np.float64)

    def __call__(self, step: int) -> float:
        return float(self.values(np.array([step]))[0])


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
    elif kind in ("one_cycle", "one_cycle_momentum"):
        pct = params.get("pct_start", 0.3)
        ends = [pct * total - 1, 2 * pct * total - 2] if params.get("three_phase") else [pct * total - 1]
        steps |= {int(np.floor(end)) + 1 for end in ends}
    return tuple(sorted(step for step in steps if 0 < step < total))


def compile_schedule(
    spec: Mapping[str, Any], run_steps: int, where: str, peak: float | None = None, key_range: Range | None = None
) -> Schedule:
    """A schedule mapping from the config -> a step -> value function.

    Parameters converted and checked up front (the values of the key in `key_range`, the key's), lengths resolved to
    steps, and each ``PEAK`` parameter not given set to `peak` (the optimizer's value)."""
    spec = dict(spec)
    kind = spec.pop("schedule", None)
    if not isinstance(kind, str) or kind not in SCHEDULES:
        from tinker_exp.errors import suggest

        given = "missing (a schedule mapping needs one)" if kind is None else f"{kind} is not a schedule kind"
        raise ConfigError(f"{where}.schedule: {given}" + suggest(str(kind), SCHEDULES, "kinds:"))
    total = run_steps
    if spec.get("total_steps") is not None:
        total = TOTAL_STEPS.convert(spec["total_steps"], f"{where}.total_steps", run_steps)
    spec.pop("total_steps", None)
    function, declared = SCHEDULES[kind], PARAMS[kind]
    # `+override=[lr_wsd,lr_cosine]` merges the two `lr` mappings key by key; the later file's schedule wins,
    # and parameters only the earlier kind takes are dropped (said aloud). Unknown names still fail below.
    leftovers = sorted(set(spec) - set(declared) & set().union(*PARAMS.values()))
    if leftovers:
        said = [name for name in leftovers if spec[name] is not None]  # a null (a preset's "the optimizer's") says nothing
        if said:
            warnings.warn(
                f"{where}: ignoring {', '.join(said)}, not parameters of {kind} (left from an earlier override file?)", stacklevel=2
            )
        spec = {k: v for k, v in spec.items() if k not in leftovers}
    unknown = sorted(set(spec) - set(declared))
    if unknown:
        from tinker_exp.errors import suggest

        takes = [*declared, "total_steps"]
        raise ConfigError(f"{where}.{unknown[0]}: {kind} has no parameter {unknown[0]}" + suggest(str(unknown[0]), takes, f"{kind} takes"))
    given = {name: value for name, value in spec.items() if value is not None}
    spec = {name: declared[name].convert(value, f"{where}.{name}", total, key_range) for name, value in given.items()}
    if peak is not None:
        spec |= {name: peak for name, param in declared.items() if param.peak and name not in spec}
    fractions = {name: value for name, value in given.items() if declared[name].fraction_given(value)}
    missing = sorted(name for name in _required(kind) if name not in spec)
    if missing:
        raise ConfigError(f"{where}.{missing[0]}: {kind} needs {' and '.join(missing)} (no default)")
    _check_consistency(kind, spec, total, where)
    _warn_vanished_phases(kind, spec, fractions, total, where)
    defaults = _defaults(kind)
    params = {name: spec.get(name, defaults.get(name)) for name in declared if name in spec or name in defaults}
    boundaries = _boundaries(kind, spec, total)
    return Schedule(kind, total, lambda steps: function(steps, total, **spec), boundaries, where, params, fractions)


def schedule_defaults(kind: str) -> dict[str, Any]:
    """A schedule kind's parameters that have defaults, with them ({} for a kind that is not one)."""
    return _defaults(kind) if kind in SCHEDULES else {}


def _defaults(kind: str) -> dict[str, Any]:
    parameters = inspect.signature(SCHEDULES[kind]).parameters.values()
    return {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is not p.empty}


def _required(kind: str) -> list[str]:
    parameters = inspect.signature(SCHEDULES[kind]).parameters.values()
    return [p.name for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
