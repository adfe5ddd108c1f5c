"""The converter: OmegaConf values -> exactly float / tuple, or an error naming the key and value."""


import pytest
from omegaconf import OmegaConf

from tinker_exp.errors import ConfigError
from tinker_exp.optim.convert import OVERRIDE_KEYS, check_like_verl, convert_params
from tinker_exp.optim.plan import build_plan
from tinker_exp.config.schema import OptimizerConfig


def convert(yaml_text: str) -> dict:
    return convert_params(OmegaConf.create(yaml_text))


def test_yaml_ints_and_lists_become_float_and_tuple():
    params = convert("{lr: 1, eps: 1, weight_decay: 0, betas: [0, 0.95]}")
    assert params == {"lr": 1.0, "eps": 1.0, "weight_decay": 0.0, "betas": (0.0, 0.95)}
    assert all(type(params[k]) is float for k in ("lr", "eps", "weight_decay"))
    assert type(params["betas"]) is tuple and all(type(b) is float for b in params["betas"])


def test_cli_style_values_and_numeric_strings():
    params = convert_params(OmegaConf.from_dotlist(["lr=5e-4", "weight_decay=0", "betas=[0.9,0.95]"]))
    assert params == {"lr": 5e-4, "weight_decay": 0.0, "betas": (0.9, 0.95)}
    assert convert_params({"lr": "3e-4"}) == {"lr": 3e-4}


def test_plain_python_containers_and_none():
    assert convert_params(None) == {}
    assert convert_params({"lr": None, "betas": (0.8, 0.9)}) == {"betas": (0.8, 0.9)}


@pytest.mark.parametrize(
    "node, message",
    [
        ({"lr": True}, "override.lr: expected a number, got True (bool)"),
        ({"weight_decay": False}, "override.weight_decay: expected a number, got False (bool)"),
        ({"lr": float("nan")}, "override.lr: expected a finite number, got nan"),
        ({"eps": float("inf")}, "override.eps: expected a finite number, got inf"),
        ({"lr": "-inf"}, "override.lr: expected a finite number, got '-inf'"),
        ({"lr": "fast"}, "override.lr: expected a number, got 'fast' (str)"),
        ({"lr": [1e-3]}, "override.lr: expected a number, got [0.001] (list)"),
        ({"betas": [0.9]}, "override.betas: expected two values [beta1, beta2], got 1: [0.9]"),
        ({"betas": [0.9, 0.95, 0.99]}, "override.betas: expected two values [beta1, beta2], got 3"),
        ({"betas": 0.9}, "override.betas: expected a list of two numbers [beta1, beta2], got 0.9"),
        ({"betas": "0.9,0.95"}, "override.betas: expected a list of two numbers"),
        ({"betas": [0.9, 1.0]}, "override.betas[1]: 1.0 is not in [0, 1)"),
        ({"betas": [-0.1, 0.9]}, "override.betas[0]: -0.1 is not in [0, 1)"),
        ({"betas": [True, 0.9]}, "override.betas[0]: expected a number, got True (bool)"),
        ({"betas": [0.9, "x"]}, "override.betas[1]: expected a number, got 'x' (str)"),
        ({"lr": -1e-4}, "override.lr: must be >= 0, got -0.0001"),
        ({"weight_decay": -1}, "override.weight_decay: must be >= 0, got -1"),
        ({"eps": 0}, "override.eps: must be > 0, got 0"),
        ({"eps": -1e-8}, "override.eps: must be > 0, got -1e-08"),
        ({"momentom": 0.9}, "override.momentom: not an override key; did you mean momentum? (the keys: lr, betas, eps, weight_decay, momentum"),
        ([1, 2], "override: expected a mapping"),
    ],
)
def test_rejections_name_the_key_and_value(node, message):
    with pytest.raises(ConfigError) as info:
        convert_params(node)
    assert message in str(info.value)


def test_zero_lr_is_allowed():
    assert convert_params({"lr": 0}) == {"lr": 0.0}


def test_check_like_verl_rejects_wrong_types_and_missing_keys():
    group_types = {"lr": float, "betas": tuple, "eps": float, "weight_decay": float}
    check_like_verl({"lr": 1e-3, "betas": (0.9, 0.95)}, group_types, "AdamW")
    with pytest.raises(ConfigError, match=r"override.lr: 1 is an int; AdamW's param groups hold float"):
        check_like_verl({"lr": 1}, group_types, "AdamW")
    with pytest.raises(ConfigError, match=r"override.betas: \[0.9, 0.95\] is a list; .* hold tuple"):
        check_like_verl({"betas": [0.9, 0.95]}, group_types, "AdamW")
    with pytest.raises(ConfigError, match=r"optimizer SGD has no param-group key betas"):
        check_like_verl({"betas": (0.9, 0.95)}, {"lr": float}, "SGD")


def test_plan_sends_the_same_converted_values_every_step():
    plan = build_plan(OmegaConf.create({"lr": 1, "betas": [0.9, 0.95]}), OptimizerConfig(), total_steps=5)
    assert len(plan) == 5 and all(step == {"lr": 1.0, "betas": (0.9, 0.95)} for step in plan)
    assert plan.keys == ("lr", "betas")
    assert plan.optimizer_values == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def test_plan_without_override_sends_nothing():
    plan = build_plan(None, OptimizerConfig(), total_steps=3)
    assert list(plan) == [{}, {}, {}] and plan.keys == ()


def test_plan_checks_the_optimizer_values_too():
    bad = OptimizerConfig()
    bad.eps = 0.0
    with pytest.raises(ConfigError, match=r"optimizer.eps: must be > 0"):
        build_plan(None, bad, total_steps=3)



def test_known_keys_include_verls_optim_step_params():
    """verl declares four keys; its check takes any key the groups hold (momentum for SGD, ...)."""
    from verl.workers.engine_workers_tinker import OptimStepParams

    assert set(OptimStepParams.__annotations__) <= set(OVERRIDE_KEYS)
    assert OVERRIDE_KEYS[:4] == ("lr", "betas", "eps", "weight_decay")
