"""Every config in conf/ composes; the typed schema fails bad types at compose time; the CLI fails fast."""

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from helpers import CONF_DIR, compose, optimizer_for, planned, run_cli
from tinker_exp.config import TrainerConfig
from tinker_exp.run import validate
from tinker_exp.errors import ConfigError

GROUPS = ["model", "lora", "data", "optimizer", "backend", "logger", "trainer"]
TRAINER_KEYS = [field.name for field in fields(TrainerConfig)]


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def typed(cfg):
    return OmegaConf.to_object(cfg)


@pytest.mark.parametrize("group, option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes_and_validates(group, option):
    cfg = compose(f"{group}={option}")
    validate(typed(cfg))


@pytest.mark.parametrize("option", options("override"))
def test_every_override_file_composes_and_validates(option):
    plan = validate(typed(compose(*optimizer_for(option), f"+override={option}")))
    assert plan.keys, f"conf/override/{option}.yaml sends nothing"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["+override=constant"], {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}),
        (
            ["+override=constant", "override.lr=5e-4", "override.weight_decay=0", "override.betas=[0.9,0.95]"],
            {"lr": 5e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0},
        ),
        (["+override.lr=5e-4"], {"lr": 5e-4}),
        ([], {}),
    ],
)
def test_the_documented_override_forms(overrides, expected):
    plan = validate(typed(compose(*overrides)))
    assert plan[0] == expected and plan[len(plan) - 1] == expected


def test_plain_override_without_plus_is_a_hydra_error():
    with pytest.raises(HydraException):
        compose("override=constant")


@pytest.mark.parametrize(
    "override", ["optimizer.lr=fast", "backend.device=tpu", "trainer.steps=1.5", "backend.num_workers=two"]
)
def test_wrong_types_fail_at_compose_time(override):
    with pytest.raises((ValidationError, HydraException)):
        typed(compose(override))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.batch_size=6"], "trainer.batch_size=6 must split evenly over backend.num_workers=2"),
        (["trainer.steps=0"], "trainer.steps: must be >= 1"),
        (["data.path=/nonexistent.jsonl"], "data.path: no such file"),
        (["optimizer.betas=[0.9,1.2]"], "optimizer.betas[1]: 1.2 is not in [0, 1)"),
    ],
)
def test_inconsistent_configs_are_config_errors(overrides, message):
    with pytest.raises(ConfigError) as info:
        validate(typed(compose(*overrides)))
    assert message in str(info.value)


def test_cli_bad_override_exits_nonzero_with_a_clear_message(tmp_path):
    result = run_cli("+override=constant", "override.betas=[0.9,1.02]", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert "override.betas[1]: 1.02 is not in [0, 1)" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "args, line",
    [
        (["optimizer.lr=abc"], "optimizer.lr: expected a number, got 'abc' (str)"),
        (["backend.device=tpu"], "backend.device: expected one of auto, cpu, cuda, got 'tpu'"),
        (["trainer.steps=1.5"], "trainer.steps: expected an integer, got 1.5 (float)"),
        (["trainer.foo=1"], f"trainer.foo: trainer has no key foo (trainer's keys: {', '.join(TRAINER_KEYS)})"),
        (["+override=nonexistent"], f"+override=nonexistent: override has no option nonexistent (options: {', '.join(options('override'))})"),
        (["trainer.steps=[1"], "'trainer.steps=[1': no viable alternative at input '[1'"),
        (["data.path=~/chat.jsonl"], "data.path=~/chat.jsonl: Hydra reads this value only in quotes: type "
                                     "'data.path=\"~/chat.jsonl\"' (or write $HOME/chat.jsonl, which the shell expands)"),  # fmt: skip
        (["trainer.batch_size=0"], "trainer.batch_size: must be >= 1, got 0"),
        (["backend.micro_batch_size=0"], "backend.num_workers=2, backend.nodes=1 and backend.micro_batch_size=0 must be >= 1"),
        (["checkpoint.keep_last=-1"], "checkpoint.keep_last=-1 must be >= 0"),
        (["lora=r8", "lora.alpha=0"], "lora.alpha: must be >= 1, got 0"),
        (["lora.target_modules=[]"], "lora.target_modules: expected a module name, a regex or a non-empty list of names, got []"),
        (["+override.lr={schedule:cosine,value:true}"], "override.lr.value: expected a number, got True (bool)"),
        (["+override.lr={schedule:cosine,value:1e-3,min_ratio:2}"], "override.lr.min_ratio: 2 is not in [0, 1]"),
        (["+override.lr={schedule:linear,start:fast,end:0}"], "override.lr.start: expected a number, got 'fast' (str)"),
        (["plan_steps=[5,20]"], "plan_steps[1]: 20 is not a step of this run (0 .. 19)"),
        (["plan_steps=[x]"], "plan_steps[0]: expected an integer, got 'x' (str)"),
    ],
)
def test_every_kind_of_bad_input_is_one_line_and_exit_2(tmp_path, args, line):
    """Hydra's own compose errors too: the same form as ours, before anything is started or written."""
    result = run_cli(*args, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"tinker_exp: config error: {line}"], result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "config.yaml").exists()


def test_cli_key_the_optimizer_lacks_lists_the_keys_it_accepts(tmp_path):
    result = run_cli("+override.momentum=0.9", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert (
        "override.momentum: optimizer AdamW has no param-group key momentum; "
        "keys AdamW accepts: lr, betas, eps, weight_decay"
    ) in result.stderr
    assert "Traceback" not in result.stderr


def test_a_config_error_starts_no_worker_and_imports_no_ray():
    code = (
        "import sys\n"
        "from helpers import compose\n"
        "from tinker_exp.run import run\n"
        "from tinker_exp.errors import ConfigError\n"
        "from pathlib import Path\n"
        "try:\n"
        "    run(compose('+override.lr=nan'), Path(sys.argv[1]))\n"
        "except ConfigError as e:\n"
        "    print('error:', e)\n"
        "print(sorted(m for m in ('ray', 'verl', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "/nonexistent-run-dir"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parent,
    ).stdout
    assert "error: override.lr: expected a finite number, got nan" in out
    assert out.strip().endswith("[]")


def test_dry_run_validates_and_starts_nothing(tmp_path):
    result = run_cli("+override=constant", "override.lr=1", "dry_run=true", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "dry run: wrote" in result.stdout
    assert planned(tmp_path, "lr") == [1.0] * 20
    assert not (tmp_path / "metrics.jsonl").exists()


def search_space_ends(space: str) -> list:
    """The two ends of a preset's `interval(a, b)` (wrapped in `int(...)` or `tag(log, ...)`), as the sweeper draws them."""
    import re

    low, high = re.search(r"interval\(([^,]+),([^)]+)\)", space).groups()
    cast = int if space.startswith("int(") else float
    return [cast(float(low)), cast(float(high))]


@pytest.mark.parametrize("option", options("hparams_search"))
def test_every_search_preset_composes_and_dry_runs_at_both_ends_of_its_space(option, tmp_path):
    """A trial's schedule parameters (a warmup drawn as a fraction of the schedule, say) make a valid plan."""
    params = compose(f"hparams_search={option}", with_hydra=True).hydra.sweeper.params
    ends = {key: search_space_ends(space) for key, space in params.items() if "interval(" in space}
    assert ends, f"conf/hparams_search/{option}.yaml searches no interval"
    for end in (0, 1):
        chosen = [f"{key}={values[end]}" for key, values in ends.items()]
        plan = validate(typed(compose(f"hparams_search={option}", *chosen)))
        assert plan.schedules, option
    # hydra.mode=RUN: one ordinary run of the preset's config (a preset is a sweep, with or without -m)
    result = run_cli(f"hparams_search={option}", "hydra.mode=RUN", "dry_run=true", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "plan.json").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_a_searched_warmup_fraction_follows_trainer_steps():
    """The cosine search draws its warmup as a fraction: the same trial warms up over the same share of any run."""
    short = validate(typed(compose("hparams_search=lr_cosine", "override.lr.warmup_steps=0.25")))
    long = validate(typed(compose("hparams_search=lr_cosine", "override.lr.warmup_steps=0.25", "trainer.steps=4000")))
    assert short.schedules["lr"].params["warmup_steps"] == 5 and long.schedules["lr"].params["warmup_steps"] == 1000


@pytest.mark.parametrize("given, max_norm", [("0", float("inf")), ("null", float("inf")), ("2.5", 2.5), ("1", 1.0)])
def test_clip_grad_0_or_null_is_no_clipping(given, max_norm):
    """As Tinker's grad_clip_norm=0 and HF's max_grad_norm=0: verl is given an infinite max_norm (a 0 would zero
    every gradient); tests/test_optimizers_ray.py trains with it."""
    assert typed(compose(f"optimizer.clip_grad={given}")).optimizer.max_grad_norm == max_norm


def int_keys(schema: type, prefix: str = "") -> list[str]:
    """Every key of the schema (and its groups) whose type is int, or int or None."""
    import dataclasses
    import typing

    found = []
    for name, hint in typing.get_type_hints(schema).items():
        if name not in {f.name for f in dataclasses.fields(schema)}:
            continue
        args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is typing.Union else [hint]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            found += int_keys(args[0], f"{prefix}{name}.")
        elif args == [int]:
            found.append(f"{prefix}{name}")
    return found


def test_every_int_key_given_a_fraction_says_what_it_takes_in_one_line():
    """OmegaConf's words ("Value '1.5' of type 'float' could not be converted to Integer") become ours, for each int
    key of the schema: the key, what it takes, what it got; a whole float says what to write."""
    from hydra.errors import ConfigCompositionException

    from tinker_exp.config import Config
    from tinker_exp.config.compose_errors import compose_message

    keys = int_keys(Config)
    assert {"trainer.steps", "rl.updates_per_batch", "backend.num_workers", "checkpoint.keep_last"} <= set(keys)
    for key in keys:
        for value, line in (("1.5", f"{key}: expected an integer, got 1.5 (float)"),
                            ("1e3", f"{key}: expected an integer, got 1000.0 (float): write 1000")):  # fmt: skip
            with pytest.raises(ConfigCompositionException) as refused:
                compose(f"{key}={value}")
            assert compose_message(refused.value) == line
