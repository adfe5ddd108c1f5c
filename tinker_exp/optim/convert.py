"""OmegaConf values -> verl ``OptimStepParams``, converted explicitly and validated strictly.

Pure Python (stdlib + omegaconf): config errors and dry runs never pay for torch, verl or ray.

verl's ``TinkerTrainingWorker.optimizer_step`` rejects an ``int`` where a param group holds a ``float``
and a ``list`` where it holds a ``tuple``. YAML and the CLI hand us ints (``0``) and lists
(``[0.9, 0.95]``), so we convert to exactly ``float`` and ``tuple`` here, once, and reject anything
that is not a finite number in range, naming the config key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from tinker_exp.errors import ConfigError, a_or_an

from tinker_exp.optim.optimizers import GROUP_KEYS, TINKER_SPELLINGS, VOCABULARY, WORKER_KEYS

OVERRIDE_KEYS = VOCABULARY
"""Every key an override may name (which of them an optimizer accepts: tinker_exp.optim.optimizers), in a stable
order. verl's OptimStepParams declares lr, betas, eps and weight_decay; its check takes any key the groups hold."""


def plain(node: Any) -> Any:
    """An OmegaConf node as plain dicts and lists (interpolations resolved); anything else as it is."""
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node


def override_mapping(node: Any, where: str = "override") -> Mapping[str, Any]:
    """The override node as a mapping of known keys only; None (no override selected) is empty."""
    node = plain(node)
    if node is None:
        return {}
    if not isinstance(node, Mapping):
        raise ConfigError(f"{where}: expected a mapping of {list(OVERRIDE_KEYS)}, got {node!r}")
    unknown = [str(key) for key in node if key not in GROUP_KEYS and key not in TINKER_SPELLINGS and key not in WORKER_KEYS]
    if unknown:
        from tinker_exp.errors import suggest

        known = [*OVERRIDE_KEYS, *TINKER_SPELLINGS]
        raise ConfigError(f"{where}.{unknown[0]}: not an override key" + suggest(unknown[0], known, "the keys:"))
    return node


def betas_pair(value: Any, key: str) -> list[Any]:
    """betas as its two components (each still a constant or a schedule); anything else is an error."""
    if not isinstance(value, (ListConfig, Sequence)) or isinstance(value, str):
        raise ConfigError(f"{key}: expected a list of two numbers [beta1, beta2], got {value!r}")
    items = list(value)
    if len(items) != 2:
        raise ConfigError(f"{key}: expected two values [beta1, beta2], got {len(items)}: {items!r}")
    return items


def number(value: Any, key: str) -> float:
    """Explicit float(): ints and numeric strings are fine; bool, NaN, inf and words are not."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a number, got {value!r} (bool)")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise ConfigError(f"{key}: expected a number, got {value!r} (str)") from None
    else:
        raise ConfigError(f"{key}: expected a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(number):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    return number


@dataclass(frozen=True)
class Range:
    """An interval a number must lie in.

    ``contains`` takes a float or a numpy array (a whole plan's column, checked at once), so the plain values, schedule
    parameters and every step of a plan share one rule and one message."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is excluded
    high_open: bool = False

    def contains(self, x: Any) -> Any:
        above = True if self.low is None else (x > self.low if self.low_open else x >= self.low)
        below = True if self.high is None else (x < self.high if self.high_open else x <= self.high)
        return above & below

    def error(self, value: Any, where: str) -> ConfigError:
        if self.high is None:
            return ConfigError(f"{where}: must be {'>' if self.low_open else '>='} {self.low:g}, got {value!r}")
        low, high = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return ConfigError(f"{where}: {value!r} is not in {low}{self.low:g}, {self.high:g}{high}")

    def check(self, converted: float, value: Any, where: str) -> None:
        if not self.contains(converted):
            raise self.error(value, where)


RANGES = {
    "lr": Range(low=0.0),
    "betas": Range(0.0, 1.0, high_open=True),  # each component
    "eps": Range(low=0.0, low_open=True),
    "weight_decay": Range(low=0.0),
    "momentum": Range(0.0, 1.0, high_open=True),
    "dampening": Range(0.0, 1.0),
    "alpha": Range(0.0, 1.0),
    "lr_decay": Range(low=0.0),
    "initial_accumulator_value": Range(low=0.0),
    "momentum_decay": Range(low=0.0),
    "grad_clip_norm": Range(low=0.0),  # 0: no clipping
    "warmup_steps": Range(low=0.0),  # AdamWScheduleFree's own warmup, in steps (0: none)
    "r": Range(low=0.0),
    "weight_lr_power": Range(low=0.0),
}
"""Where each optimizer value must lie (verl would take any float; AdamW misbehaves outside these)."""


def _betas(value: Any, key: str) -> tuple[float, float]:
    items = betas_pair(value, key)
    betas = tuple(number(item, f"{key}[{i}]") for i, item in enumerate(items))
    for i, beta in enumerate(betas):
        RANGES["betas"].check(beta, items[i], f"{key}[{i}]")
    return betas  # type: ignore[return-value]


def convert_value(key: str, value: Any, where: str) -> float | tuple[float, float]:
    """Convert one optimizer value; ``where`` is the config path shown in errors (e.g. ``override``)."""
    name = f"{where}.{key}"
    if key not in RANGES:
        raise ConfigError(f"{name}: not a float key; only float keys can be sent per step")
    if key == "betas":
        return _betas(value, name)
    converted = number(value, name)
    RANGES[key].check(converted, value, name)
    return converted


def convert_params(node: Any, where: str = "override") -> dict[str, Any]:
    """An override node (DictConfig or dict) -> a plain dict that is a valid ``OptimStepParams``.

    ``None`` (no override selected) and ``null`` values mean "not sent", as in verl.
    """
    node = override_mapping(node, where)
    ordered = (*OVERRIDE_KEYS, *(key for key in node if key not in OVERRIDE_KEYS))
    return {key: convert_value(key, node[key], where) for key in ordered if key in node and node[key] is not None}


def param_group_types(optimizer_values: Mapping[str, Any]) -> dict[str, type]:
    """The types the worker's param groups will hold: the optimizer is built from these very values."""
    return {key: type(value) for key, value in optimizer_values.items()}


def check_like_verl(params: Mapping[str, Any], group_types: Mapping[str, type], optimizer: str) -> None:
    """verl's ``_apply_optim_step_params`` check, run before any worker starts.

    Same semantics: every key must exist in the param groups, and each value must be an instance of
    the type the groups hold. A test holds this against verl's own function on a real optimizer.
    """
    for key, value in params.items():
        if value is None:
            continue
        if key not in group_types:
            raise ConfigError(
                f"override.{key}: optimizer {optimizer} has no param-group key {key} (it has {', '.join(sorted(group_types))})"
            )
        if not isinstance(value, group_types[key]):
            raise ConfigError(
                f"override.{key}: {value!r} is {a_or_an(type(value).__name__)}; "
                f"{optimizer}'s param groups hold {group_types[key].__name__}"
            )


FLAT_NAMES = {key: ("beta1", "beta2") if key == "betas" else (key,) for key in OVERRIDE_KEYS}
"""Each key's values as logged and plotted: betas as its two components."""


def flat_values(prefix: str, values: Mapping[str, Any]) -> dict[str, float]:
    """{'betas': (0.9, 0.95), 'lr': 1e-3} -> {'PREFIX/lr': 1e-3, 'PREFIX/beta1': 0.9, 'PREFIX/beta2': 0.95}."""
    name = (lambda key: f"{prefix}/{key}") if prefix else (lambda key: key)
    row = {}
    for key in OVERRIDE_KEYS:
        if key == "betas" and key in values:
            row[name("beta1")], row[name("beta2")] = values[key]
        elif key in values:
            row[name(key)] = values[key]
    return row


def nested_values(flat: Mapping[str, float]) -> dict[str, Any]:
    """flat_values' inverse: {'lr': 1e-3, 'beta1': 0.9, 'beta2': 0.95} -> {'lr': 1e-3, 'betas': (0.9, 0.95)}."""
    params: dict[str, Any] = {}
    for key, names in FLAT_NAMES.items():
        if names[0] in flat:
            params[key] = tuple(flat[name] for name in names) if key == "betas" else flat[key]
    return params
