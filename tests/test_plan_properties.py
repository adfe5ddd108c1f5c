"""Property: any override (constants and schedules, valid or not) is either a plan whose every step verl accepts
on a real AdamW, or a ConfigError; never any other exception. Hypothesis, derandomized (a fixed seed), no deadline."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import verl_adamw
from tinker_exp.config import OptimizerConfig
from tinker_exp.errors import ConfigError
from tinker_exp.optim.plan import build_plan, optimizer_values
from tinker_exp.optim.schedules import PARAMS, Param, _required

# Anything a YAML file or the CLI can hold, and a few things they cannot.
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10**6, 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "abc", "1e-3", "nan", "-inf", "0x10", " 2 "]),
    st.lists(st.integers(-3, 60), max_size=4),
    st.dictionaries(st.integers(-3, 60), st.floats(-1, 1), max_size=3),
)
small = st.one_of(
    st.floats(-2.0, 2.0, allow_nan=False), st.integers(-2, 3), st.sampled_from([1e-8, 1e-3, 0.9, 0.999, 1e5, 1e300, -1e300])
)
steps_ints = st.one_of(st.integers(0, 12), st.integers(-2, 60))  # mostly short: phases that meet the run's end
lengths = st.one_of(steps_ints, st.floats(0.0, 1.0), st.floats(-0.5, 1.5))  # counts, and fractions in and out of [0, 1]


def plausible(param: Param) -> st.SearchStrategy:
    """Values of the parameter's own type, in and around its range."""
    if param.kind == "int":
        return steps_ints
    if param.kind == "length":
        return lengths
    if param.kind == "choice":
        return st.sampled_from([*param.choices, "sqrt"])
    if param.kind == "lengths":
        return st.lists(lengths, max_size=4)
    if param.kind == "points":
        return st.dictionaries(steps_ints, small, max_size=4)
    return small


def schedule(kind: str) -> st.SearchStrategy:
    """Required parameters mostly present (else every example is a 'missing parameter'), the rest optional; a
    peak is optional too (missing or null, it is the optimizer's value)."""
    params = {name: st.one_of(plausible(param), plausible(param), plausible(param), junk) for name, param in PARAMS[kind].items()}
    required = {name: params.pop(name) for name in _required(kind) if not PARAMS[kind][name].peak}
    extra = {"total_steps": st.one_of(steps_ints, junk), "warmup": junk}
    fixed = {"schedule": st.sampled_from([kind] * 9 + ["sawtooth"]), **required}
    return st.fixed_dictionaries(fixed, optional={**params, **extra})


any_schedule = st.sampled_from(sorted(PARAMS)).flatmap(schedule)
value = st.one_of(any_schedule, any_schedule, small, junk)
override = st.one_of(
    st.fixed_dictionaries({"lr": value}),  # one key at a time reaches the evaluation of every step more often
    st.fixed_dictionaries({"weight_decay": value}),
    st.fixed_dictionaries({"betas": st.lists(st.one_of(st.sampled_from([0.9, 0.95]), value), min_size=2, max_size=2)}),
    st.fixed_dictionaries({}, optional={"lr": value, "eps": value, "weight_decay": value, "betas": st.one_of(junk, value)}),
    st.dictionaries(st.sampled_from(["lr", "momentum", "betas"]), value, max_size=2),
)


@pytest.fixture(scope="module")
def adamw():
    return verl_adamw(optimizer_values(OptimizerConfig()))


@settings(max_examples=1500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(override=override, steps=st.integers(1, 24))
def test_an_override_is_a_plan_verl_accepts_or_a_config_error(adamw, override, steps):
    from verl.workers.engine_workers_tinker import _apply_optim_step_params

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # leftover parameters of merged files are said aloud; not the point here
            plan = build_plan(override, OptimizerConfig(), steps)
    except ConfigError as e:
        assert str(e).startswith(("override", "optimizer")), str(e)  # it names the key
        return
    assert len(plan) == steps
    for params in plan:
        _apply_optim_step_params(adamw, params)  # verl's own strict check: raises on any wrong key or type
        for group in adamw.param_groups:
            assert {key: group[key] for key in params} == params
            # builtin float and tuple, never a numpy scalar (verl takes a float64 once, then rejects every float)
            assert {key: type(group[key]) for key in params} == {key: type(optimizer_values(OptimizerConfig())[key]) for key in params}
            assert all(type(beta) is float for beta in group["betas"])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(override=junk)
def test_an_override_that_is_no_mapping_is_a_config_error(override):
    if override in (None, {}):
        assert list(build_plan(override, OptimizerConfig(), 3)) == [{}] * 3  # nothing selected: nothing sent
        return
    with pytest.raises(ConfigError, match=r"^override"):
        build_plan(override, OptimizerConfig(), 3)
