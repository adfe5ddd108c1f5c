"""Population-based training through its sweeper (hydra/sweeper=pbt): every bad input one line and exit 2 before any
member starts, the members' start values, the end of a population (table, population_results.yaml, the replay
command, report.png read back as data), and real populations on the local launcher and the local Slurm cluster."""

from __future__ import annotations

import os
import sys

import pytest

from tinker_exp.main import main

BASE = ["-m", "hydra/sweeper=pbt", "hydra/launcher=local", "+override=lr_cosine", "logger=none"]
LR = "override.lr.value=tag(log,interval(1e-4,3e-3))"
POPULATION_ENV = "TINKER_EXP_POPULATION"  # the contract with the member side (tinker_exp.sweep.pbt.POPULATION_ENV)
GOOD = [LR, "trainer.steps=8", "trainer.eval_every=2", "hydra.sweeper.interval=2"]


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m tinker_exp ARGS`, in this process."""
    monkeypatch.setattr(sys, "argv", ["tinker_exp", *args])
    with pytest.raises(SystemExit) as stopped:
        main()
    out = capsys.readouterr()
    return stopped.value.code, out.out, out.err


def without(args: list[str], key: str) -> list[str]:
    return [a for a in args if not a.startswith(key + "=")]


# --- bad input: one line, exit 2, nothing written, no member started ------------------------------------------

FROZEN = "cannot change within a run"
BAD = [
    (["hydra.sweeper.population=1"], "hydra.sweeper.population: 1 must be an int >= 2 (a population exploits its other members)"),
    (["hydra.sweeper.population=two"], "hydra.sweeper.population: 'two' must be an int >= 2"),
    (["hydra.sweeper.interval=0"], "hydra.sweeper.interval: 0 must be an int >= 1 (steps between boundaries)"),
    (["hydra.sweeper.interval=3"], "hydra.sweeper.interval=3: not a multiple of trainer.eval_every=2; each boundary must be an evaluation step"),
    (["trainer.eval_every=0"], "hydra.sweeper.interval=2: trainer.eval_every=0 evaluates only after the last step; each boundary must be an evaluation step"),
    (["hydra.sweeper.interval=6"], "hydra.sweeper.interval=6: trainer.steps=8 leaves no boundary to train on from (needs trainer.steps >= 2 * interval = 12)"),
    (["data.val_fraction=null"], "hydra.sweeper=pbt: members are scored at evaluations, and there is no validation data (data.val_path or data.val_fraction)"),
    (["hydra.sweeper.quantile=0"], "hydra.sweeper.quantile: 0 must be in (0, 0.5]"),
    (["hydra.sweeper.quantile=0.6"], "hydra.sweeper.quantile: 0.6 must be in (0, 0.5]"),
    (["hydra.sweeper.perturb=[0.8,0]"], "hydra.sweeper.perturb: 0 in [0.8, 0] must be a number > 0"),
    (["hydra.sweeper.perturb=[0.8,-1.2]"], "hydra.sweeper.perturb: -1.2 in [0.8, -1.2] must be a number > 0"),
    (["hydra.sweeper.perturb=[]"], "hydra.sweeper.perturb: [] must be a non-empty list of factors, e.g. [0.8, 1.2]"),
    (["hydra.sweeper.resample_probability=1.5"], "hydra.sweeper.resample_probability: 1.5 must be in [0, 1]"),
    (["hydra.sweeper.force_exploit={member:0,step:3,donor:1}"],
     "hydra.sweeper.force_exploit: {'member': 0, 'step': 3, 'donor': 1}: step 3 is not a boundary (a multiple of 2 below trainer.steps=8)"),
    (["hydra.sweeper.force_exploit={member:1,step:2,donor:1}"],
     "hydra.sweeper.force_exploit: {'member': 1, 'step': 2, 'donor': 1}: member and donor must be two members in 0..3"),
    # the space: empty, malformed, or over a key a member cannot change in flight
    (["~" + LR], "hydra.sweeper.params: no search space; give one in hydra.sweeper.params or on the command line"),
    (["override.lr.value=tag(log,interval(0,3e-3))"], "override.lr.value: a log-scale interval must start above 0, not 0"),
    (["override.lr.value=interval(3e-3,1e-4)"], "override.lr.value: interval(0.003, 0.0001) is empty"),
    (["override.lr.value=tag(log,interval(1e-4,3e-3"], "'override.lr.value=tag(log,interval(1e-4,3e-3': no viable alternative at input"),
    (["model.init_seed=choice(1,2)"], f"hydra.sweeper.params: model.init_seed: {FROZEN}: the model is built once, when the member's workers start"),
    (["lora=r8,r32"], f"hydra.sweeper.params: lora: {FROZEN}: the LoRA adapters are built once"),
    (["optimizer=adamw,sgd"], f"hydra.sweeper.params: optimizer: {FROZEN}: the optimizer's class and construction values are fixed when the workers start"),
    (["optimizer.lr=interval(1e-4,1e-3)"], f"hydra.sweeper.params: optimizer.lr: {FROZEN}: the optimizer's class"),
    (["backend.num_workers=1,2"], f"hydra.sweeper.params: backend.num_workers: {FROZEN}: the member's workers"),
    (["trainer.seed=choice(0,1)"], f"hydra.sweeper.params: trainer.seed: {FROZEN}: every member shares trainer.seed (the data order)"),
    (["trainer.steps=8,10"], f"hydra.sweeper.params: trainer.steps: {FROZEN}: members share their steps"),
    (["trainer.batch_size=4,8"], f"hydra.sweeper.params: trainer.batch_size: {FROZEN}: members share their batches"),
    (["data.split_seed=choice(0,1)"], f"hydra.sweeper.params: data.split_seed: {FROZEN}: every member reads the same data"),
    (["+override=lr_cosine,lr_wsd"], f"hydra.sweeper.params: +override: {FROZEN}: a preset is chosen once per run"),
    (["trainer.eval_every=2,4"], "hydra.sweeper.params: trainer.eval_every: not a value sent with every optimizer step; PBT searches override.* keys"),
]  # fmt: skip


@pytest.mark.parametrize("args, line", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_population_is_one_line_and_exit_2_before_any_member(monkeypatch, capsys, tmp_path, args, line):
    args = [*BASE, f"hydra.sweep.dir={tmp_path / 'sweep'}", *GOOD, *args]
    if args[-1].startswith("~"):  # the space left out
        args = [a for a in args if a != args[-1] and a != args[-1][1:]]
    if args[-1].startswith("+override="):  # the preset searched instead of given
        args = [a for a in args if a != "+override=lr_cosine"]
    code, out, err = run_main(monkeypatch, capsys, *args)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.strip().startswith(f"tinker_exp: config error: {line}"), err
    assert "Traceback" not in out + err and "HYDRA_FULL_ERROR" not in out + err
    assert not (tmp_path / "sweep").exists() and POPULATION_ENV not in os.environ


def test_a_member_whose_start_values_fail_the_runs_checks_is_named_with_them_before_any_member(monkeypatch, capsys, tmp_path):
    """A negative weight decay is refused by the override's checks: every member is named, nothing is written."""
    args = [*BASE, f"hydra.sweep.dir={tmp_path / 'sweep'}", *GOOD, "+override.weight_decay=interval(-0.2,-0.1)"]
    code, out, err = run_main(monkeypatch, capsys, *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert lines[0] == "tinker_exp: config error: 4 of 4 sweep points are wrong; no job was started:", err
    assert [line.split(" [")[0].strip() for line in lines[1:]] == [f"job {m}" for m in range(4)]
    assert all("weight_decay" in line for line in lines[1:]) and not (tmp_path / "sweep").exists()
