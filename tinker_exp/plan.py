"""The per-step override plan: one converted, validated ``OptimStepParams`` per optimizer step.

Pure Python. The whole plan is built and checked before any worker starts, so a bad value never costs
a Ray start-up. Step 0 is the first optimizer step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tinker_exp.overrides import (
    OVERRIDE_KEYS,
    ConfigError,
    check_like_verl,
    convert_params,
    convert_value,
    param_group_types,
)

OPTIMIZER_VALUE_KEYS = OVERRIDE_KEYS  # AdamW's param-group values we build the optimizer from


@dataclass(frozen=True)
class Plan:
    """What is sent with each ``optimizer_step``; an empty dict means no override for that step."""

    steps: list[dict[str, Any]]
    optimizer_values: dict[str, Any]  # the values the worker's optimizer is built from

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, step: int) -> dict[str, Any]:
        return self.steps[step]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for key in OVERRIDE_KEYS if any(key in params for params in self.steps))


def optimizer_values(optimizer_cfg: Any) -> dict[str, Any]:
    """The optimizer's own lr/betas/eps/weight_decay as exactly float and tuple.

    The worker builds AdamW from this dict, so its param groups hold these types and verl's check at
    the worker agrees with ours.
    """
    return {key: convert_value(key, getattr(optimizer_cfg, key), "optimizer") for key in OPTIMIZER_VALUE_KEYS}


def _as_container(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def build_plan(override_node: Any, optimizer_cfg: Any, total_steps: int) -> Plan:
    """Generate, convert and check the values for every step in [0, total_steps)."""
    if total_steps < 1:
        raise ConfigError(f"trainer.steps: must be >= 1, got {total_steps}")
    values = optimizer_values(optimizer_cfg)
    group_types = param_group_types(values)
    override = _as_container(override_node) or {}
    if not isinstance(override, Mapping):
        raise ConfigError(f"override: expected a mapping of {list(OVERRIDE_KEYS)}, got {override!r}")
    for key, spec in override.items():
        if isinstance(spec, Mapping):
            raise ConfigError(
                f"override.{key}: per-step schedules are not supported yet; give a constant value, got {spec!r}"
            )
    params = convert_params(override)
    name = getattr(optimizer_cfg.name, "value", optimizer_cfg.name)
    check_like_verl(params, group_types, str(name))
    return Plan(steps=[dict(params) for _ in range(total_steps)], optimizer_values=values)
