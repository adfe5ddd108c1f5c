"""Our pre-launch check agrees with verl's own check on a real AdamW built the way the worker builds it."""

import numpy as np
import pytest
from omegaconf import OmegaConf
from verl.workers.engine_workers_tinker import _apply_optim_step_params

from helpers import verl_adamw
from tinker_exp.errors import ConfigError
from tinker_exp.optim.convert import check_like_verl, convert_params, param_group_types
from tinker_exp.optim.plan import build_plan, optimizer_values
from tinker_exp.config.schema import OptimizerConfig


@pytest.fixture
def built():
    values = optimizer_values(OmegaConf.create({"name": "AdamW", "lr": 1, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0}))
    return values, verl_adamw(values)


def test_param_groups_hold_exactly_the_converted_types(built):
    values, optimizer = built
    for group in optimizer.param_groups:
        assert {key: type(group[key]) for key in values} == param_group_types(values)
        assert {key: group[key] for key in values} == values


@pytest.mark.parametrize(
    "raw",
    [
        {"lr": 0, "weight_decay": 0, "eps": 1, "betas": [0.9, 0.95]},
        {"lr": 3e-4},
        {"betas": [0, 0.5]},
    ],
)
def test_converted_values_pass_verls_check_and_land_in_every_group(built, raw):
    values, optimizer = built
    params = convert_params(OmegaConf.create(raw))
    check_like_verl(params, param_group_types(values), "AdamW")
    _apply_optim_step_params(optimizer, params)
    for group in optimizer.param_groups:
        for key, value in params.items():
            assert group[key] == value and type(group[key]) is type(value)


@pytest.mark.parametrize(
    "raw, verl_error",
    [
        ({"lr": 1}, TypeError),
        ({"weight_decay": 0}, TypeError),
        ({"eps": 1}, TypeError),
        ({"betas": [0.9, 0.95]}, TypeError),
        ({"momentum": 0.9}, ValueError),
    ],
)
def test_unconverted_values_fail_both_checks(built, raw, verl_error):
    values, optimizer = built
    with pytest.raises(verl_error):
        _apply_optim_step_params(optimizer, raw)
    with pytest.raises(ConfigError):
        check_like_verl(raw, param_group_types(values), "AdamW")


def test_schema_defaults_build_the_same_optimizer():
    values = optimizer_values(OptimizerConfig())
    optimizer = verl_adamw(values)
    assert {key: optimizer.param_groups[0][key] for key in values} == values


def test_a_numpy_float_would_poison_the_group_and_the_plan_never_sends_one():
    """verl's check is isinstance: a numpy float64 passes as a float, the group then holds a float64, and the next
    plain float fails. The plan's values are arrays, so each step's are made builtin when it is sent."""
    values = optimizer_values(OptimizerConfig())
    poisoned = verl_adamw(values)
    _apply_optim_step_params(poisoned, {"lr": np.float64(1e-3)})
    with pytest.raises(TypeError):
        _apply_optim_step_params(poisoned, {"lr": 1e-3})

    optimizer = verl_adamw(values)
    override = {"lr": {"schedule": "cosine", "value": 1e-3, "warmup_steps": 10}, "eps": 1e-8,
                "betas": [0.9, {"schedule": "linear", "start": 0.95, "end": 0.999}]}  # fmt: skip
    plan = build_plan(override, OptimizerConfig(), 200)
    for step in range(len(plan)):
        _apply_optim_step_params(optimizer, plan[step])  # raises at the step after a float64 had slipped through
    assert {key: type(optimizer.param_groups[0][key]) for key in values} == {key: type(v) for key, v in values.items()}
    assert [type(beta) for beta in optimizer.param_groups[1]["betas"]] == [float, float]
