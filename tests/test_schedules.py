"""Schedules against the published reference implementations, composition, rejections, dry run (a real run that
follows a composed plan: test_optimizers_ray.py)."""

import json
import math

import numpy as np
import pytest
import torch
import transformers.optimization as hf
from omegaconf import OmegaConf
from verl.utils.torch_functional import get_cosine_schedule_with_warmup as verl_cosine

from helpers import CONF_DIR, compose, optimizer_for, planned, run_cli, run_module
from tinker_exp.run import run, validate
from tinker_exp.errors import ConfigError
from tinker_exp.optim.plan import build_plan
from tinker_exp.optim.preview import PLAN_FILE, plot_steps, read_plan_file, write_plan_file
from tinker_exp.optim.schedules import PARAMS, compile_schedule
from tinker_exp.config.schema import OptimizerConfig

PEAK = 3e-4
T = 1000
STEPS = list(range(0, T)) + [T, T + 7]
WITHIN = list(range(0, T + 1))  # HF's cosine is never evaluated past its end; there it rises back, ours holds


def lambda_of(factory, **kwargs):
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    return factory(optimizer, **kwargs).lr_lambdas[0]


def ours(spec: dict, total: int = T):
    return compile_schedule(spec, total, "override.lr")


def assert_same(schedule, reference_lambda, scale=PEAK, steps=STEPS):
    """Every step at once (as a plan evaluates it) and one step at a time agree with the reference."""
    values = schedule.values(np.array(steps))
    for step, value in zip(steps, values.tolist()):
        assert value == pytest.approx(scale * reference_lambda(step), rel=1e-12, abs=1e-18), step
    for step in steps[::97]:
        assert schedule(step) == values[steps.index(step)]


@pytest.mark.parametrize("warmup, min_ratio, cycles", [(0, 0.0, 0.5), (100, 0.1, 0.5), (37, 0.0, 1.5), (1, 0.3, 0.25)])
def test_cosine_matches_verl_and_hf(warmup, min_ratio, cycles):
    schedule = ours({"schedule": "cosine", "value": PEAK, "warmup_steps": warmup, "min_ratio": min_ratio, "num_cycles": cycles})
    verl_lambda = lambda_of(verl_cosine, num_warmup_steps=warmup, num_training_steps=T, min_lr_ratio=min_ratio, num_cycles=cycles)
    assert_same(schedule, verl_lambda, steps=WITHIN)
    assert_same(schedule, lambda_of(hf.get_cosine_with_min_lr_schedule_with_warmup, num_warmup_steps=warmup, num_training_steps=T, num_cycles=cycles, min_lr_rate=min_ratio), steps=WITHIN)
    assert schedule(2 * T) == schedule(T) == pytest.approx(PEAK * verl_lambda(T), rel=1e-12)  # held past the end


@pytest.mark.parametrize("warmup, cycles", [(0, 1), (50, 3)])
def test_cosine_restarts_matches_hf(warmup, cycles):
    schedule = ours({"schedule": "cosine_restarts", "value": PEAK, "warmup_steps": warmup, "num_cycles": cycles})
    assert_same(schedule, lambda_of(hf.get_cosine_with_hard_restarts_schedule_with_warmup, num_warmup_steps=warmup, num_training_steps=T, num_cycles=cycles))


@pytest.mark.parametrize("decay_shape", ["linear", "cosine", "1-sqrt"])
@pytest.mark.parametrize("warmup_shape", ["linear", "cosine", "1-sqrt"])
@pytest.mark.parametrize("stable", [None, 400])
def test_wsd_matches_hf(decay_shape, warmup_shape, stable):
    spec = {"schedule": "wsd", "value": PEAK, "warmup_steps": 100, "decay_steps": 200, "decay_shape": decay_shape,
            "warmup_shape": warmup_shape, "min_ratio": 0.1}
    if stable is not None:
        spec["stable_steps"] = stable
    reference = lambda_of(hf.get_wsd_schedule, num_warmup_steps=100, num_decay_steps=200, num_training_steps=T,
                          num_stable_steps=stable, warmup_type=warmup_shape, decay_type=decay_shape, min_lr_ratio=0.1)
    assert_same(ours(spec), reference)


def test_linear_matches_hf_when_it_ends_at_zero():
    schedule = ours({"schedule": "linear", "start": PEAK, "end": 0.0, "warmup_steps": 100})
    assert_same(schedule, lambda_of(hf.get_linear_schedule_with_warmup, num_warmup_steps=100, num_training_steps=T))
    rising = ours({"schedule": "linear", "start": 0.95, "end": 0.999}, total=50)
    assert rising(0) == 0.95 and rising(50) == pytest.approx(0.999) and rising(25) == pytest.approx(0.9745)


@pytest.mark.parametrize("warmup, timescale", [(100, None), (10, 500), (0, None)])
def test_inverse_sqrt_matches_hf(warmup, timescale):
    spec = {"schedule": "inverse_sqrt", "value": PEAK, "warmup_steps": warmup, "timescale": timescale}
    assert_same(ours(spec), lambda_of(hf.get_inverse_sqrt_schedule, num_warmup_steps=warmup, timescale=timescale))


@pytest.mark.parametrize("power", [1.0, 2.0, 0.5])
def test_polynomial_matches_hf(power):
    spec = {"schedule": "polynomial", "value": PEAK, "end": 1e-6, "warmup_steps": 100, "power": power}
    reference = lambda_of(hf.get_polynomial_decay_schedule_with_warmup, num_warmup_steps=100, num_training_steps=T, lr_end=1e-6, power=power)
    assert_same(ours(spec), reference)


@pytest.mark.parametrize(
    "spec, scheduler, kwargs",
    [
        ({"schedule": "step", "value": PEAK, "step_size": 30, "gamma": 0.5}, torch.optim.lr_scheduler.StepLR, {"step_size": 30, "gamma": 0.5}),
        ({"schedule": "multistep", "value": PEAK, "milestones": [100, 250, 600], "gamma": 0.3}, torch.optim.lr_scheduler.MultiStepLR, {"milestones": [100, 250, 600], "gamma": 0.3}),
        ({"schedule": "exponential", "value": PEAK, "gamma": 0.995}, torch.optim.lr_scheduler.ExponentialLR, {"gamma": 0.995}),
    ],
)
def test_decays_match_torch_schedulers(spec, scheduler, kwargs):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    reference = scheduler(optimizer, **kwargs)
    values = ours(spec).values(np.arange(T)).tolist()
    for step in range(T):
        assert values[step] == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-9), step
        optimizer.step()
        reference.step()


def test_keyframes_are_piecewise_linear_and_flat_outside():
    schedule = ours({"schedule": "keyframes", "points": {0: 1e-5, 100: 3e-4, 2000: 3e-5}}, total=3000)
    assert schedule(0) == 1e-5 and schedule(100) == 3e-4 and schedule(2000) == 3e-5 and schedule(2999) == 3e-5
    assert schedule(50) == pytest.approx((1e-5 + 3e-4) / 2)
    assert schedule(1050) == pytest.approx((3e-4 + 3e-5) / 2)


def test_every_step_of_a_multi_key_plan_is_converted():
    override = OmegaConf.create({
        "lr": {"schedule": "cosine", "value": 1e-3, "warmup_steps": 10, "min_ratio": 0.1},
        "betas": [0.9, {"schedule": "linear", "start": 0.95, "end": 0.999}],
        "weight_decay": {"schedule": "step", "value": 1, "step_size": 50, "gamma": 0.5},
    })
    plan = build_plan(override, OptimizerConfig(), 100)
    assert len(plan) == 100 and plan.keys == ("lr", "betas", "weight_decay")
    for params in plan:  # no numpy scalar: verl would take a float64 once, then reject every plain float
        assert type(params["lr"]) is float and type(params["weight_decay"]) is float
        assert type(params["betas"]) is tuple and all(type(b) is float for b in params["betas"])
    assert plan[0]["lr"] == 0.0 and plan[10]["lr"] == 1e-3 and plan[99]["betas"][1] == pytest.approx(0.999 - 0.049 / 100)
    assert plan[49]["weight_decay"] == 1.0 and plan[50]["weight_decay"] == 0.5
    assert plan.boundaries() == [10, 50]


@pytest.mark.parametrize(
    "override, message",
    [
        # a value of the key given as a parameter is named as given; a computed one by its first bad step
        ({"betas": [0.9, {"schedule": "linear", "start": 0.95, "end": 1.02}]}, "override.betas[1].end: 1.02 is not in [0, 1)"),
        ({"lr": {"schedule": "linear", "start": 1e-3, "end": -1e-3}}, "override.lr.end: must be >= 0, got -0.001"),
        ({"eps": {"schedule": "linear", "start": 1e-8, "end": -1e-8}}, "override.eps.end: must be > 0, got -1e-08"),
        ({"lr": {"schedule": "cosine", "value": -1e-3, "warmup_steps": 5}}, "override.lr.value: must be >= 0, got -0.001"),
        ({"lr": {"schedule": "keyframes", "points": {0: 1e-3, 50: -1e-4}}}, "override.lr.points[50]: must be >= 0, got -0.0001"),
        ({"beta1": {"schedule": "linear", "start": 0.9, "end": 1.2}}, "override.beta1.end: 1.2 is not in [0, 1)"),
        ({"learning_rate": {"schedule": "cosine", "value": -1.0}}, "override.learning_rate.value: must be >= 0, got -1.0"),
        ({"betas": [0.9, {"schedule": "exponential", "value": 0.99, "gamma": 1.001}]},
         "override.betas[1] at step 11 (exponential): 1.0009"),
        ({"eps": {"schedule": "exponential", "value": 1e-8, "gamma": 0.0}}, "override.eps.gamma: must be > 0, got 0.0"),
        ({"lr": {"schedule": "cosine", "value": 1e-3, "warmup_steps": 150}}, "override.lr.warmup_steps: 150 is longer than the schedule (100 steps)"),
        ({"lr": {"schedule": "wsd", "value": 1e-3, "warmup_steps": 10, "decay_steps": 95}}, "override.lr: warmup_steps + stable_steps + decay_steps = 105 runs past the end (100 steps)"),
        ({"lr": {"schedule": "wsd", "value": 1e-3, "warmup_steps": 10, "decay_steps": 50, "stable_steps": 50}}, "= 110 runs past the end"),
        ({"lr": {"schedule": "wsd", "value": 1e-3, "warmup_steps": 1, "decay_steps": 5, "decay_shape": "sqrt"}}, "override.lr.decay_shape: sqrt is not a choice; did you mean 1-sqrt? (choices: linear, cosine, 1-sqrt)"),
        ({"lr": {"schedule": "keyframes", "points": {0: 1e-5, 80: 3e-4, 40: 3e-5}}}, "override.lr.points: keyframes out of order: steps [0, 80, 40]"),
        ({"lr": {"schedule": "keyframes", "points": {0: 1e-5, 400: 3e-4}}}, "override.lr.points: keyframe at step 400 is past the end (100 steps)"),
        ({"lr": {"schedule": "multistep", "value": 1e-3, "milestones": [50, 20]}}, "override.lr.milestones: must be strictly increasing"),
        ({"lr": {"schedule": "cosine", "value": 1e-3, "warmup": 10}}, "override.lr.warmup: cosine has no parameter warmup; did you mean warmup_steps? (cosine takes value, warmup_steps, min_ratio, num_cycles, total_steps)"),
        ({"lr": {"schedule": "wsd", "value": 1e-3}}, "override.lr.decay_steps: wsd needs decay_steps and warmup_steps (no default)"),
        ({"lr": {"schedule": "sawtooth", "value": 1e-3}}, "override.lr.schedule: sawtooth is not a schedule kind (kinds: constant, linear,"),
        ({"lr": {"value": 1e-3}}, "override.lr.schedule: missing (a schedule mapping needs one)"),
        ({"lr": {"schedule": "cosine", "value": 1e-3, "warmup_steps": 2.5}}, "override.lr.warmup_steps: 2.5 is not in [0, 1]: a float is a fraction of the schedule (100 steps), an integer a number of steps"),
        ({"lr": {"schedule": "cosine", "value": 1e-3, "warmup_steps": 1.5}}, "override.lr.warmup_steps: 1.5 is not in [0, 1]: a float is a fraction"),
        ({"lr": {"schedule": "cosine", "value": 1e-3, "warmup_steps": -0.1}}, "override.lr.warmup_steps: -0.1 is not in [0, 1]"),
        ({"lr": {"schedule": "cosine", "value": 1e-3, "warmup_steps": float("nan")}}, "override.lr.warmup_steps: nan is not in [0, 1]"),
        ({"lr": {"schedule": "step", "value": 1e-3, "step_size": 0.004}}, "override.lr.step_size: 0.004 of the schedule (100 steps) is 0 steps; must be >= 1"),
        ({"lr": {"schedule": "multistep", "value": 1e-3, "milestones": [0.5, 1.5]}}, "override.lr.milestones[1]: 1.5 is not in [0, 1]"),
        ({"lr": {"schedule": "multistep", "value": 1e-3, "milestones": [0.5, 0.501]}}, "override.lr.milestones: must be strictly increasing, got [50, 50]"),
        ({"lr": {"schedule": "wsd", "value": 1e-3, "warmup_steps": 0.5, "decay_steps": 0.6}}, "override.lr: warmup_steps + stable_steps + decay_steps = 110 runs past the end (100 steps)"),
        ({"lr": {"schedule": "inverse_sqrt", "value": 1e-3, "timescale": 0.0}}, "override.lr.timescale: 0.0 of the schedule (100 steps) is 0 steps; must be >= 1"),
        ({"betas": {"schedule": "linear", "start": 0.9, "end": 0.95}}, "override.betas: schedule each component on its own"),
        ({"lr": {"schedule": "cosine", "value": float("nan")}}, "override.lr.value: expected a finite number, got nan"),
        # Schedule parameters are held to the standard of plain values: types, ranges, one error naming the parameter.
        ({"lr": {"schedule": "cosine", "value": True}}, "override.lr.value: expected a number, got True (bool)"),
        ({"lr": {"schedule": "cosine", "value": 1e-3, "min_ratio": False}}, "override.lr.min_ratio: expected a number, got False (bool)"),
        ({"lr": {"schedule": "linear", "start": "fast", "end": 0}}, "override.lr.start: expected a number, got 'fast' (str)"),
        ({"lr": {"schedule": "cosine", "value": 1e-3, "min_ratio": 2}}, "override.lr.min_ratio: 2 is not in [0, 1]"),
        ({"lr": {"schedule": "cosine", "value": 1e-3, "num_cycles": -1}}, "override.lr.num_cycles: must be > 0, got -1"),
        ({"lr": {"schedule": "cosine_restarts", "value": 1e-3, "num_cycles": 0}}, "override.lr.num_cycles: must be >= 1, got 0"),
        ({"lr": {"schedule": "step", "value": 1e-3, "step_size": 10, "gamma": -0.5}}, "override.lr.gamma: must be > 0, got -0.5"),
        ({"lr": {"schedule": "multistep", "value": 1e-3, "milestones": [10, "x"]}}, "override.lr.milestones[1]: expected an integer, got 'x'"),
        ({"lr": {"schedule": "keyframes", "points": {0: 1e-3, 5: "high"}}}, "override.lr.points[5]: expected a number, got 'high' (str)"),
        ({"lr": {"schedule": "polynomial", "value": 1e-3, "power": 0}}, "override.lr.power: must be > 0, got 0"),
        ({"lr": {"schedule": "cosine", "value": 1e-3, "total_steps": 0}}, "override.lr.total_steps: must be >= 1, got 0"),
        ({"lr": {"schedule": "exponential", "value": 1e-3, "gamma": 1e5}}, "override.lr at step 62 (exponential): cannot be computed"),
    ],
)
def test_bad_plans_name_key_schedule_and_first_bad_step(override, message):
    with pytest.raises(ConfigError) as info:
        build_plan(override, OptimizerConfig(), 100)
    assert message in str(info.value)


def test_a_warmup_that_fills_a_polynomial_schedule_is_a_plan_not_a_division_by_zero():
    plan = build_plan({"lr": {"schedule": "polynomial", "value": 1e-3, "end": 1e-5, "warmup_steps": 5, "total_steps": 5}}, OptimizerConfig(), 8)
    assert [params["lr"] for params in plan] == pytest.approx([0.0, 2e-4, 4e-4, 6e-4, 8e-4, 1e-5, 1e-5, 1e-5])


def test_every_schedule_parameter_is_declared_with_a_type_and_range():
    import inspect

    from tinker_exp.optim.schedules import PARAMS, SCHEDULES

    assert set(PARAMS) == set(SCHEDULES)
    for kind, function in SCHEDULES.items():
        keyword = {p.name for p in inspect.signature(function).parameters.values() if p.kind is p.KEYWORD_ONLY}
        assert set(PARAMS[kind]) == keyword, kind


def test_schedule_length_defaults_to_the_run_and_can_be_set():
    plan = build_plan({"lr": {"schedule": "linear", "start": 1.0, "end": 0.0, "total_steps": 10}}, OptimizerConfig(), 20)
    assert plan[5]["lr"] == 0.5 and plan[10]["lr"] == 0.0 and plan[19]["lr"] == 0.0


def test_composed_files_later_wins_and_cli_tweaks():
    plan = validate(OmegaConf.to_object(compose("+override=[lr_wsd,beta2_warmup,wd_cosine]")))
    assert plan.keys == ("lr", "betas", "weight_decay") and set(plan.schedules) == {"lr", "betas[1]", "weight_decay"}
    assert plan.schedules["lr"].kind == "wsd"
    later = validate(OmegaConf.to_object(compose("+override=[lr_wsd,lr_cosine]")))
    assert later.schedules["lr"].kind == "cosine"
    with pytest.warns(UserWarning, match=r"override.lr: ignoring end, not parameters of cosine") as said:
        validate(OmegaConf.to_object(compose("+override=[lr_linear,lr_cosine]")))  # lr_linear's `start: null` says nothing
    assert len(said) == 1
    tweaked = validate(OmegaConf.to_object(compose("+override=lr_cosine", "override.lr.warmup_steps=5", "override.lr.min_ratio=0.5")))
    assert tweaked[4]["lr"] == pytest.approx(0.8e-3) and tweaked[19]["lr"] > 0.5e-3
    constant = validate(OmegaConf.to_object(compose("+override=lr_cosine", "override.lr=3e-4")))
    assert constant.schedules == {} and constant[0] == constant[19] == {"lr": 3e-4}


def test_every_shipped_schedule_file_dry_runs(tmp_path):
    for path in sorted((CONF_DIR / "override").glob("*.yaml")):
        run_dir = tmp_path / path.stem
        dcfg = compose(*optimizer_for(path.stem), f"+override={path.stem}", "dry_run=true")
        plan = validate(OmegaConf.to_object(dcfg))  # the plan the config makes (dry_run is no part of it)
        run(dcfg, run_dir)
        rebuilt = read_plan_file(run_dir / PLAN_FILE)
        assert len(rebuilt) == 20 and rebuilt.keys == plan.keys, path.name
        for name in plan.columns:
            assert np.array_equal(rebuilt.column(name), plan.column(name)), (path.name, name)
        rows = json.loads((run_dir / PLAN_FILE).read_text())["rows"]
        assert {0, 1, 2, 19} <= {row["step"] for row in rows}, path.name
        assert (run_dir / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert not (run_dir / "metrics.jsonl").exists()


EVERY_KIND = {
    "lr": {"schedule": "wsd", "value": 1e-3, "warmup_steps": 100, "decay_steps": 2000, "decay_shape": "1-sqrt", "min_ratio": 0.1},
    "betas": [{"schedule": "keyframes", "points": {0: 0.8, 500: 0.9, 9000: 0.85}},
              {"schedule": "polynomial", "value": 0.999, "end": 0.95, "power": 2.0, "warmup_steps": 10}],
    "eps": {"schedule": "multistep", "value": 1e-8, "milestones": [10, 4000, 7000], "gamma": 0.5},
    "weight_decay": {"schedule": "cosine_restarts", "value": 0.1, "warmup_steps": 50, "num_cycles": 3, "total_steps": 8000},
}  # fmt: skip


def test_plan_json_is_small_and_rebuilds_the_plan_exactly(tmp_path):
    plan = build_plan(EVERY_KIND, OptimizerConfig(), 10_000)
    write_plan_file(plan, tmp_path / PLAN_FILE, [1234])
    doc = json.loads((tmp_path / PLAN_FILE).read_text())
    assert doc["steps"] == 10_000 and doc["boundaries"] == plan.boundaries()
    assert doc["override"]["betas"][0] == {"schedule": "keyframes", "points": {"0": 0.8, "500": 0.9, "9000": 0.85}, "total_steps": 10_000}
    row = next(row for row in doc["rows"] if row["step"] == 1234)
    assert row == {"step": 1234, "lr": plan[1234]["lr"], "beta1": plan[1234]["betas"][0], "beta2": plan[1234]["betas"][1],
                   "eps": plan[1234]["eps"], "weight_decay": plan[1234]["weight_decay"]}  # fmt: skip
    rebuilt = read_plan_file(tmp_path / PLAN_FILE)
    assert rebuilt.keys == plan.keys and set(rebuilt.schedules) == set(plan.schedules)
    for name in plan.columns:
        assert np.array_equal(rebuilt.column(name), plan.column(name)), name
    assert (tmp_path / PLAN_FILE).stat().st_size < 16_000


def test_a_plan_json_whose_values_the_formulas_no_longer_give_is_refused(tmp_path):
    write_plan_file(build_plan(EVERY_KIND, OptimizerConfig(), 10_000), tmp_path / PLAN_FILE)
    text = (tmp_path / PLAN_FILE).read_text()
    (tmp_path / PLAN_FILE).write_text(text.replace('"num_cycles": 3', '"num_cycles": 2'))  # another formula, in effect
    with pytest.raises(ValueError, match=r"plan.json: step \d+: weight_decay is .* here, the run's plan has"):
        read_plan_file(tmp_path / PLAN_FILE)


def test_the_plot_of_a_long_plan_keeps_every_phase_boundary_and_every_jump():
    plan = build_plan({"lr": {"schedule": "step", "value": 1.0, "step_size": 70_001, "gamma": 0.5},
                       "weight_decay": {"schedule": "cosine", "value": 0.1, "warmup_steps": 12_345}}, OptimizerConfig(), 1_000_000)  # fmt: skip
    steps = plot_steps(plan)
    assert len(steps) <= 5_100 and steps[0] == 0 and steps[-1] == 999_999 and np.all(np.diff(steps) > 0)
    kept = set(steps.tolist())
    for boundary in plan.boundaries():
        assert {boundary - 1, boundary} <= kept
    for jump in range(70_001, 1_000_000, 70_001):  # each value of the step decay appears where it starts
        assert plan.column("lr")[steps][np.searchsorted(steps, jump)] == plan.column("lr")[jump]
    for name in ("lr", "weight_decay"):  # each slice's extremes: the drawn line reaches as high and low as the plan
        drawn, every = plan.column(name)[steps], plan.column(name)
        assert (drawn.min(), drawn.max()) == (every.min(), every.max())
    short = build_plan({"lr": {"schedule": "cosine", "value": 1.0}}, OptimizerConfig(), 1500)
    assert plot_steps(short).tolist() == list(range(1500))  # a short plan: every step


def test_dry_run_cli_prints_table_and_imports_nothing_heavy(tmp_path):
    code = (
        "import sys, runpy\n"
        "sys.argv = ['tinker_exp', '+override=[lr_wsd,beta2_warmup]', 'trainer.steps=1000000', 'dry_run=true',\n"
        "            'override.lr.decay_steps=20000', 'plan_steps=[123456]', 'hydra.run.dir=%s']\n"
        "try:\n"
        "    runpy.run_module('tinker_exp', run_name='__main__')\n"
        "finally:\n"
        "    print('HEAVY', sorted(m for m in ('torch', 'verl', 'ray') if m in sys.modules))\n" % tmp_path
    )
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=CONF_DIR.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stdout
    table_steps = [int(line.split()[0]) for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert {0, 1, 2, 123456, 979999, 980000, 999999} <= set(table_steps)  # first steps, asked for, decay start, last
    assert planned(tmp_path, "lr")[-1] == pytest.approx(1e-4, rel=1e-3)  # min_ratio 0.1
    assert sorted(p.name for p in tmp_path.glob("plan.*")) == ["plan.json", "plan.png"]
    assert (tmp_path / "plan.json").stat().st_size < 16_000
    # Any step's values, later, from the run dir alone
    shown = run_module("tinker_exp.optim.preview", str(tmp_path / "plan.json"), "777777", timeout=60, cwd=CONF_DIR.parent)
    assert shown.returncode == 0, shown.stderr
    (line,) = [line for line in shown.stdout.splitlines() if line.split()[:1] == ["777777"]]
    assert line.split()[1:] == [f"{planned(tmp_path, key)[777777]:.6g}" for key in ("lr", "beta1", "beta2")]


def test_cli_bad_schedule_exits_before_workers(tmp_path):
    result = run_cli("+override=beta2_warmup", "override.betas.1.end=1.5", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == ["tinker_exp: config error: override.betas[1].end: 1.5 is not in [0, 1)"]


# Past the end: a run 3x longer than the schedule. A kind with an end holds its value at the end of its formula
# (step total_steps); the kinds without one go on by their formula.
HOLDS = {
    "constant": ({"value": PEAK}, PEAK),
    "linear": ({"start": PEAK, "end": 1e-5, "warmup_steps": 0.1}, 1e-5),
    "cosine": ({"value": PEAK, "warmup_steps": 0.1, "min_ratio": 0.1}, 0.1 * PEAK),
    "cosine_restarts": ({"value": PEAK, "warmup_steps": 0.1, "num_cycles": 3}, 0.0),
    "wsd": ({"value": PEAK, "warmup_steps": 0.1, "decay_steps": 0.2, "decay_shape": "1-sqrt", "min_ratio": 0.1}, 0.1 * PEAK),
    "polynomial": ({"value": PEAK, "end": 1e-6, "warmup_steps": 0.1, "power": 2.0}, 1e-6),
    "keyframes": ({"points": {0: 1e-5, 100: PEAK, 800: 3e-5}}, 3e-5),
    "one_cycle": ({"value": PEAK, "three_phase": True}, PEAK / 25 / 1e4),
    "one_cycle_momentum": ({"base_momentum": 0.85, "max_momentum": 0.95}, 0.95),
}
GOES_ON = {
    "step": ({"value": PEAK, "step_size": 300, "gamma": 0.5}, lambda s: PEAK * 0.5 ** (s // 300)),
    "multistep": ({"value": PEAK, "milestones": [0.5, 2000], "gamma": 0.5}, lambda s: PEAK * 0.5 ** ((s >= 500) + (s >= 2000))),
    "exponential": ({"value": PEAK, "gamma": 0.999}, lambda s: PEAK * 0.999**s),
    "inverse_sqrt": ({"value": PEAK, "warmup_steps": 100}, lambda s: PEAK / math.sqrt(s / 100)),
}


def test_every_kind_is_said_to_hold_or_go_on_past_its_end():
    from tinker_exp.optim.schedules import SCHEDULES

    assert set(HOLDS) | set(GOES_ON) == set(SCHEDULES) and not set(HOLDS) & set(GOES_ON)


@pytest.mark.parametrize("kind", sorted(HOLDS))
def test_a_schedule_with_an_end_holds_its_end_value_past_it(kind):
    params, end = HOLDS[kind]
    plan = build_plan({"lr": {"schedule": kind, **params, "total_steps": T}}, OptimizerConfig(), 3 * T)
    after = plan.column("lr")[T:]
    assert after[0] == pytest.approx(end, abs=1e-18) and np.all(after == after[0]), kind  # step T on: one value
    before = plan.column("lr")[:T]
    assert before.min() - 1e-18 <= end <= before.max() + 1e-18  # the end of the formula, not a new value


@pytest.mark.parametrize("kind", sorted(GOES_ON))
def test_a_schedule_without_an_end_goes_on_past_total_steps(kind):
    params, formula = GOES_ON[kind]
    plan = build_plan({"lr": {"schedule": kind, **params, "total_steps": T}}, OptimizerConfig(), 3 * T)
    for step in (T - 1, T, 2 * T + 1, 3 * T - 1):
        assert plan[step]["lr"] == pytest.approx(formula(step), rel=1e-12), step


OPTIMIZER = ["optimizer.lr=1e-2", "optimizer.weight_decay=0.05", "optimizer.betas=[0.8,0.99]", "optimizer.momentum=0.9"]
FOLLOWED = {"lr": 1e-2, "weight_decay": 0.05, "betas[0]": 0.8, "betas[1]": 0.99, "momentum": 0.9}
COLUMN = {"lr": "lr", "weight_decay": "weight_decay", "betas[0]": "beta1", "betas[1]": "beta2", "momentum": "momentum"}


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF_DIR / "override").glob("*.yaml")))
def test_every_shipped_schedule_peaks_at_the_optimizers_value(option):
    """`optimizer.lr=1e-2 +override=lr_cosine` peaks at 1e-2; beta2_warmup rises to the optimizer's beta2. Only
    keyframes (absolute values by step) and the constants file (fixed values by design) name their values."""
    plan = validate(OmegaConf.to_object(compose(*optimizer_for(option), f"+override={option}", *OPTIMIZER)))
    if option in ("lr_keyframes", "constant"):
        return
    preset = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "override" / f"{option}.yaml"))
    assert plan.schedules, option
    for label, schedule in plan.schedules.items():
        betas = preset.get("betas") or [preset.get("beta1"), preset.get("beta2")]  # Tinker's spelling too
        spec = betas[int(label[-2])] if label.startswith("betas") else preset[label]
        followed = [name for name, param in PARAMS[schedule.kind].items() if param.peak and spec.get(name) is None]
        assert followed and all(schedule.params[name] == FOLLOWED[label] for name in followed), (option, label)
        column = plan.column(COLUMN[label])
        if option == "beta2_warmup":  # 0.95 up to the optimizer's beta2 at the end of the run (step 20)
            assert column[0] == 0.95 and column[19] == pytest.approx(0.95 + (0.99 - 0.95) * 19 / 20)
        elif schedule.kind == "one_cycle_momentum":  # between its own base_momentum and the optimizer's value
            assert {column.max(), column.min()} == {FOLLOWED[label], schedule.params["base_momentum"]}, option
        else:
            assert column.max() == pytest.approx(FOLLOWED[label], rel=1e-12), option


def test_an_explicit_peak_wins_and_null_is_the_optimizers():
    explicit = validate(OmegaConf.to_object(compose("+override=lr_cosine", "optimizer.lr=1e-2", "override.lr.value=3e-4")))
    assert explicit.schedules["lr"].params["value"] == 3e-4 and explicit.column("lr").max() == pytest.approx(3e-4)
    plan = build_plan({"lr": {"schedule": "linear", "end": 1e-4}, "eps": {"schedule": "exponential", "value": None, "gamma": 0.5}},
                      OptimizerConfig(lr=2e-3, eps=1e-6), 10)  # fmt: skip
    assert plan[0]["lr"] == 2e-3 and plan[9]["lr"] == pytest.approx(2e-3 + (1e-4 - 2e-3) * 0.9) and plan[1]["eps"] == 5e-7
    with pytest.raises(ConfigError, match=r"override.lr.value: cosine needs value \(no default\)"):
        compile_schedule({"schedule": "cosine"}, 10, "override.lr")  # no optimizer to follow: the peak is needed


@pytest.mark.parametrize(
    "given, total, steps",
    [(0.05, 20, 1), (0.05, 1_000_000, 50_000), (0.125, 20, 3), (0.1, 25, 3), (0.02, 25, 1), (0.0, 20, 0), (1.0, 20, 20), (7, 20, 7), (1, 20, 1)],
)
def test_a_float_length_is_that_fraction_of_the_schedule_rounded_halves_up(given, total, steps):
    schedule = ours({"schedule": "cosine", "value": PEAK, "warmup_steps": given}, total=total)
    assert schedule.params["warmup_steps"] == steps and type(schedule.params["warmup_steps"]) is int
    assert schedule.fractions == ({"warmup_steps": given} if isinstance(given, float) else {})
    if 0 < steps < total:
        assert schedule.boundaries == (steps,) and schedule(steps) == PEAK


def test_fractions_are_of_the_schedules_own_length():
    plan = build_plan({"lr": {"schedule": "multistep", "value": 1.0, "milestones": [0.25, 30], "total_steps": 40}}, OptimizerConfig(), 100)
    assert plan.schedules["lr"].params["milestones"] == [10, 30] and plan.boundaries() == [10, 30]


def test_presets_follow_trainer_steps_in_the_table_plan_json_and_wandb_config(tmp_path):
    """`+override=lr_wsd trainer.steps=1000000` warms up over 50,000 steps (0.05) and decays over the last 200,000."""
    from tinker_exp.train.sinks import wandb_run_config

    result = run_cli("+override=lr_wsd", "trainer.steps=1000000", "optimizer.lr=1e-2", "dry_run=true", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "lr: wsd over 1000000 steps (warmup 50000 = 0.05, decay 200000 = 0.2, 1-sqrt)" in result.stdout
    shown = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert {"49999", "50000", "799999", "800000"} <= {row[0] for row in shown}
    assert [row[1] for row in shown if row[0] == "50000"] == ["0.01"]  # the peak: optimizer.lr
    doc = json.loads((tmp_path / PLAN_FILE).read_text())
    lr = doc["override"]["lr"]
    assert (lr["warmup_steps"], lr["decay_steps"], lr["value"], lr["fractions"]) == (50_000, 200_000, 1e-2, {"warmup_steps": 0.05, "decay_steps": 0.2})
    assert doc["boundaries"] == [50_000, 800_000]
    rebuilt = read_plan_file(tmp_path / PLAN_FILE)
    assert dict(rebuilt.schedules["lr"].params) == {k: v for k, v in lr.items() if k not in ("schedule", "total_steps", "fractions")}
    dcfg = compose("+override=lr_wsd", "trainer.steps=1000000")
    flat = wandb_run_config(OmegaConf.to_container(dcfg, resolve=True), validate(OmegaConf.to_object(dcfg)), {}, {})
    assert (flat["override.lr.warmup_steps"], flat["override.lr.decay_steps"], flat["override.lr.value"]) == (50_000, 200_000, 1e-3)
    assert not any(".fractions" in key for key in flat)


def test_cli_bad_fraction_is_one_line_naming_the_key(tmp_path):
    result = run_cli("+override=lr_wsd", "override.lr.warmup_steps=1.5", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2 and not (tmp_path / "metrics.jsonl").exists()
    assert result.stderr.strip().splitlines() == [
        "tinker_exp: config error: override.lr.warmup_steps: 1.5 is not in [0, 1]: a float is a fraction of the "
        "schedule (20 steps), an integer a number of steps"
    ]


def test_the_plot_names_each_keys_schedule_with_its_resolved_steps(tmp_path):
    from tinker_exp.optim.preview import plot_plan, plot_title

    plan = validate(OmegaConf.to_object(compose("+override=[lr_wsd,beta2_warmup]")))
    assert plot_title(plan) == "lr: wsd (warmup 1, decay 4, 1-sqrt), betas[0]: constant, betas[1]: linear"
    assert plot_plan(plan, tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    wide = validate(OmegaConf.to_object(compose("+override=[lr_wsd,beta2_warmup,wd_cosine]")))  # wrapped between keys
    assert plot_title(wide) == "lr: wsd (warmup 1, decay 4, 1-sqrt), betas[0]: constant, betas[1]: linear,\nweight_decay: cosine"


def test_a_momentum_cycle_that_runs_the_wrong_way_is_warned_of():
    """one_cycle_momentum falls from max_momentum to base_momentum while the lr rises: a peak below the floor (the
    optimizer's momentum of 0, as RMSprop's default) inverts it; torch allows it, so a warning names both."""
    with pytest.warns(UserWarning, match=r"override.momentum.max_momentum: 0.0 is below base_momentum 0.85"):
        compile_schedule({"schedule": "one_cycle_momentum", "max_momentum": 0.0}, 10, "override.momentum")
    assert compile_schedule({"schedule": "one_cycle_momentum", "max_momentum": 0.95}, 10, "override.momentum").total_steps == 10


@pytest.mark.parametrize(
    "kind, params, start",
    [
        ("linear", {"start": 1e-3, "end": 1e-4}, 0.0),
        ("cosine", {"value": 1e-3, "min_ratio": 0.1}, 0.0),
        ("cosine_restarts", {"value": 1e-3}, 0.0),
        ("wsd", {"value": 1e-3, "decay_steps": 5, "min_ratio": 0.1}, 1e-4),  # wsd warms up from its floor
        ("polynomial", {"value": 1e-3, "end": 1e-4}, 0.0),
    ],
)
def test_warmups_start_at_step_0_and_decays_reach_their_floor_one_past_the_last_step(kind, params, start):
    """What --help and docs/schedules.md say of where phases start and end, held to the formulas: from `start` at
    step 0, the peak at step warmup_steps; the end or floor at step total_steps, which a run never reaches."""
    from tinker_exp.config.cli_help import WHEN

    values = compile_schedule({"schedule": kind, "warmup_steps": 2, **params}, 20, "override.lr").values(np.arange(21))
    assert values[0] == pytest.approx(start) and values[2] == pytest.approx(1e-3)
    floor = {"cosine_restarts": 0.0, "cosine": 1e-4, "wsd": 1e-4}.get(kind, params.get("end"))
    assert values[20] == pytest.approx(floor) and values[19] > floor * 1.01  # the last step run is short of it
    assert "reaches its end or floor at step total_steps, one past the last step run" in WHEN
    assert "one past the last step run" in (CONF_DIR.parent / "docs" / "schedules.md").read_text()


def test_one_cycle_reaches_its_floor_at_the_last_step():
    values = compile_schedule({"schedule": "one_cycle", "value": 1e-3}, 20, "override.lr").values(np.arange(20))
    assert values[19] == pytest.approx(1e-3 / 25 / 1e4) and values[0] == pytest.approx(1e-3 / 25)


def test_a_phase_a_short_run_rounds_away_warns_in_one_line(tmp_path):
    """`+override=lr_wsd trainer.steps=4`: no warmup, and a 1-step decay that never lowers the lr: valid, said."""
    result = run_cli("+override=lr_wsd", "trainer.steps=4", "dry_run=true", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if "warning" in line] == [
        "tinker_exp: warning: override.lr: in a 4-step schedule, warmup_steps=0.05 rounds to 0 steps (no warmup) and "
        "decay_steps=0.2 to 1 step (a decay reaches its floor at step 4, one past the last step run: this one never "
        "lowers the value)"
    ]
    assert planned(tmp_path, "lr") == pytest.approx([1e-3] * 4)  # what the warning says: the peak at every step
    quiet = run_cli("+override=lr_wsd", "dry_run=true", f"hydra.run.dir={tmp_path / 'default'}")  # 20 steps: 1 and 4
    assert quiet.returncode == 0 and "warning" not in quiet.stderr, quiet.stderr


@pytest.mark.parametrize("steps, said", [(8, "in an 8-step schedule"), (11, "in an 11-step schedule"), (9, "in a 9-step schedule")])
def test_the_warning_puts_the_right_article_before_the_schedules_length(steps, said):
    with pytest.warns(UserWarning, match=f"^override.lr: {said}, warmup_steps=0.04 rounds to 0 steps"):
        compile_schedule({"schedule": "cosine", "value": 1e-3, "warmup_steps": 0.04}, steps, "override.lr")
