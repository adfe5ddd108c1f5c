"""Where a run starts (tinker_exp.train.start), bookkeeping with FakeWorkers: branch lineage and rows, the checks before
any worker starts, resume refusals, a complete run rerun, kept checkpoints (keep_every, keep_best) and early stop.

The real exactness (verl's workers on Ray, bitwise) is tests/test_branch_ray.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fakes import fake_workers
from helpers import compose, job_json, metrics_rows, planned, run_cli
from tinker_exp.errors import ConfigError
from tinker_exp.place import GivenWorkers
from tinker_exp.run import objective, run
from tinker_exp import config
from tinker_exp.train.start import differing

STEPS = 8
BASE = [f"trainer.steps={STEPS}", "checkpoint.every_steps=2", "checkpoint.keep_last=0", "logger=none"]
TRUNK = ["+override=lr_cosine", *BASE]


def files(run_dir: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trunk(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("trunk")
    run(compose(*TRUNK), run_dir, place=GivenWorkers(fake_workers()))
    return run_dir


def branch(trunk: Path, run_dir: Path, *extra: str, plan: str = "lr_cosine", start=None):
    start = start or fake_workers()
    run(compose(f"+override={plan}", *BASE, f"branch.from={trunk}", *extra), run_dir, place=GivenWorkers(start))
    return start


def test_a_branch_with_the_trunks_config_continues_it_and_only_reads_the_trunk(trunk, tmp_path):
    before = files(trunk)
    branch(trunk, tmp_path, "branch.step=4")
    rows, trunk_rows = metrics_rows(tmp_path), metrics_rows(trunk)
    assert [row["train/step"] for row in rows] == list(range(4, STEPS))  # the branch's own steps
    keys = ("train/loss", "train/grad_norm", "applied/lr")
    assert [[row[k] for k in keys] for row in rows] == [[row[k] for k in keys] for row in trunk_rows[4:]]
    assert files(trunk) == before
    lineage = {"from": str(trunk), "step": 4, "checkpoint": str(trunk / "checkpoints" / "step_00000004"), "trunk_wandb_run_id": None}
    assert json.loads((tmp_path / "plan.json").read_text())["branch"] == lineage
    assert job_json(tmp_path)["branch"] == lineage
    assert planned(tmp_path, "lr") == planned(trunk, "lr")  # plan.json still reads back as the run's plan


def test_a_branch_with_another_plan_starts_from_the_trunks_state_and_follows_its_own_plan(trunk, tmp_path):
    start = branch(trunk, tmp_path, "branch.step=4", "trainer.steps=10", plan="lr_wsd")
    rows, trunk_rows = metrics_rows(tmp_path), metrics_rows(trunk)
    assert [row["train/step"] for row in rows] == list(range(4, 10))  # longer than the trunk
    assert start.started[0].weight != 1.0 and rows[0]["train/loss"] == trunk_rows[4]["train/loss"]  # the trunk's state
    assert [row["applied/lr"] for row in rows] == [row["requested/lr"] for row in rows] == planned(tmp_path, "lr")[4:]
    assert planned(tmp_path, "lr") != planned(trunk, "lr") + [None, None]
    assert rows[1]["train/loss"] != trunk_rows[5]["train/loss"]


def test_branch_step_defaults_to_the_trunks_newest_checkpoint_and_a_killed_branch_resumes_its_own(trunk, tmp_path):
    branch(trunk, tmp_path, "trainer.steps=12")
    assert metrics_rows(tmp_path)[0]["train/step"] == STEPS
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000012")  # as if killed after its checkpoint at 10
    lineage = job_json(tmp_path)["branch"]
    start = branch(trunk, tmp_path, "trainer.steps=12")
    assert start.started[0].calls[0]["lr"] == planned(tmp_path, "lr")[10]  # resumed its own, not the trunk's
    assert [row["train/step"] for row in metrics_rows(tmp_path)] == list(range(STEPS, 12))
    assert lineage["step"] == STEPS and job_json(tmp_path)["branch"] == lineage  # still says where it came from
    assert json.loads((tmp_path / "plan.json").read_text())["branch"] == lineage


@pytest.mark.parametrize(
    "extra, message",
    [
        (["branch.step=3"], "branch.step: {trunk} has no checkpoint at step 3 (it has: [2, 4, 6, 8])"),
        (["branch.step=8"], "branch.step: 8 (the trunk's checkpoint) must be below trainer.steps=8: the branch would train nothing"),
        (["branch.step=4", "optimizer.eps=1e-6", "backend.num_workers=1"], "branch.from={trunk}: backend.num_workers: 2 -> 1; optimizer.eps: 1e-08 -> 1e-06 (the trunk's -> this run's); a branch must keep the trunk's model, LoRA, optimizer and workers for its checkpoint to load as saved"),
        (["branch.step=4", "lora=r8"], "branch.from={trunk}: lora.rank: 0 -> 8 (the trunk's -> this run's)"),
        (["branch.step=4", "optimizer.lr=3e-4"], "branch.from={trunk}: optimizer.lr: 0.001 -> 0.0003 (the trunk's -> this "
         "run's); a branch must keep the trunk's model, LoRA, optimizer and workers for its checkpoint to load as saved; "
         "to change optimizer.lr from the branch step on, send it with every step instead: override.lr.value=..."),
        (["branch.step=4", "optimizer.weight_decay=0.1"], "branch.from={trunk}: optimizer.weight_decay: 0.01 -> 0.1 (the "
         "trunk's -> this run's); a branch must keep the trunk's model, LoRA, optimizer and workers for its checkpoint "
         "to load as saved; to change optimizer.weight_decay from the branch step on, send it with every step instead: "
         "+override.weight_decay=..."),
        (["branch.step=4", "optimizer=sgd"], "branch.from={trunk}: optimizer.lr: 0.001 -> 0.05; optimizer.momentum: 0.0 -> "
         "0.9; optimizer.name: AdamW -> SGD; optimizer.weight_decay: 0.01 -> 0.0 (the trunk's -> this run's)"),  # no repr
    ],
    ids=["no-checkpoint-there", "step-past-the-end", "optimizer-and-workers", "lora", "lr", "weight-decay", "sgd"],
)
def test_a_branch_that_cannot_start_is_a_config_error_before_any_worker(trunk, tmp_path, extra, message):
    start = fake_workers()
    with pytest.raises(ConfigError) as caught:
        branch(trunk, tmp_path, *extra, start=start)
    assert str(caught.value).startswith(message.format(trunk=trunk))
    assert start.started == [] and not (tmp_path / "metrics.jsonl").exists()


def test_branch_from_a_dir_that_is_no_run_or_its_own_dir_or_without_checkpoints(trunk, tmp_path):
    with pytest.raises(ConfigError, match=f"branch.from={tmp_path / 'nowhere'}: not a tinker_exp run dir"):
        branch(tmp_path / "nowhere", tmp_path / "b1")
    with pytest.raises(ConfigError, match="that is this run's own dir"):
        run(compose(*TRUNK, f"branch.from={tmp_path / 'self'}"), tmp_path / "self", place=GivenWorkers(fake_workers()))
    bare = tmp_path / "bare"
    shutil.copytree(trunk, bare, ignore=shutil.ignore_patterns("checkpoints"))
    with pytest.raises(ConfigError, match="the run has no checkpoint to branch from"):
        branch(bare, tmp_path / "b2")


def test_the_cli_says_it_in_one_line_with_exit_2_and_a_dry_run_checks_it_too(trunk, tmp_path):
    result = run_cli(*TRUNK, f"branch.from={trunk}", "branch.step=5", "dry_run=true", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"tinker_exp: config error: branch.step: {trunk} has no checkpoint at step 5 (it has: [2, 4, 6, 8])"
    ]
    ok = run_cli("+override=lr_wsd", *BASE, f"branch.from={trunk}", "branch.step=4", "dry_run=true", f"hydra.run.dir={tmp_path / 'ok'}")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[0].endswith(
        f"branch of {trunk} at step 4 (its checkpoint {trunk / 'checkpoints' / 'step_00000004'}); this run's own plan from step 4"
    )


def test_a_resume_with_another_plan_is_refused_naming_each_key(trunk, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trunk, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000008")
    before, start = files(run_dir), fake_workers()
    with pytest.raises(ConfigError) as caught:
        run(compose("+override=lr_wsd", *BASE, "trainer.seed=3"), run_dir, place=GivenWorkers(start))
    message = str(caught.value)
    assert message.startswith(f"{run_dir} holds a run of another config (override.lr.")
    assert "override.lr.schedule: cosine -> wsd" in message and "trainer.seed: 0 -> 3" in message
    assert message.endswith(f"start a new run dir with branch.from={run_dir}")
    assert start.started == [] and files(run_dir) == before  # job.json aside: nothing written
    # what changes nothing trained may change
    run(compose(*TRUNK, "checkpoint.every_steps=3", "trainer.eval_every=1", "logger=none", "verbose=true"), run_dir, place=GivenWorkers(start))
    assert [row["train/step"] for row in metrics_rows(run_dir)] == list(range(STEPS))


def test_a_complete_run_rerun_says_so_and_starts_no_worker(trunk, tmp_path, caplog):
    run_dir = tmp_path / "run"
    shutil.copytree(trunk, run_dir)
    before, start = files(run_dir), fake_workers()
    with caplog.at_level("INFO", logger="tinker_exp"):
        last = run(compose(*TRUNK), run_dir, place=GivenWorkers(start))
    assert start.started == [] and last == metrics_rows(trunk)[-1]
    assert f"run complete: {run_dir} is done at step {STEPS}" in caplog.text
    assert {p: b for p, b in files(run_dir).items() if p.name != "job.json"} == {p: b for p, b in before.items() if p.name != "job.json"}


def test_keep_every_spares_branch_points_from_the_rotation(tmp_path):
    run(compose(*TRUNK, "checkpoint.every_steps=1", "checkpoint.keep_last=2", "checkpoint.keep_every=3"), tmp_path, place=GivenWorkers(fake_workers()))
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == [
        "step_00000003", "step_00000006", "step_00000007", "step_00000008",
    ]  # fmt: skip


def test_keep_best_keeps_the_best_evaluated_checkpoint_and_objective_json_names_it(tmp_path):
    # lr jumps at step 4: the weight then overshoots, so val/loss is lowest at the evaluation after step 4
    args = [
        "trainer.steps=8", "trainer.eval_every=2", "checkpoint.every_steps=2", "checkpoint.keep_last=1",
        "checkpoint.keep_best=true", "trainer.objective_mode=min", "logger=none",
        "+override.lr={schedule:keyframes,points:{0:0.1,3:0.1,4:2.0,7:2.0}}",
    ]  # fmt: skip
    run(compose(*args), tmp_path, place=GivenWorkers(fake_workers()))
    val = {row["train/step"] + 1: row["val/loss"] for row in metrics_rows(tmp_path) if "val/loss" in row}
    best_step = min(val, key=val.get)
    assert best_step != max(val)  # not the newest, which the rotation keeps anyway
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == [f"step_{best_step:08d}", "step_00000008"]
    value = objective(config.load(compose(*args)), tmp_path)
    doc = json.loads((tmp_path / "objective.json").read_text())
    assert value == val[best_step] == doc["best_checkpoint"]["value"]
    assert doc["best_checkpoint"]["path"] == str(tmp_path / "checkpoints" / f"step_{best_step:08d}")


def test_early_stop_ends_the_run_with_a_checkpoint_at_that_step(tmp_path, caplog):
    # the fake's val/loss falls by far less than min_delta each time: evaluations 2 and 3 bring no improvement
    # (the best value is still the lowest one seen)
    args = ["trainer.steps=20", "trainer.eval_every=2", "checkpoint.every_steps=5", "logger=none",
            "trainer.early_stop.patience=2", "trainer.early_stop.min_delta=10"]  # fmt: skip
    start = fake_workers()
    with caplog.at_level("INFO", logger="tinker_exp"):
        run(compose(*args), tmp_path, place=GivenWorkers(start))
    rows = metrics_rows(tmp_path)
    assert [row["train/step"] for row in rows] == list(range(6))
    assert rows[1]["val/loss"] - rows[5]["val/loss"] < 10
    assert f"early stop at step 6: best val/loss {rows[5]['val/loss']:.6g} at step 6" in caplog.text
    assert (tmp_path / "checkpoints" / "step_00000006" / "MANIFEST.json").exists()
    again = fake_workers()
    run(compose(*args), tmp_path, place=GivenWorkers(again))  # rerun: it is complete
    assert again.started == []


@pytest.mark.parametrize(
    "arg, message",
    [
        ("checkpoint.keep_every=-1", "checkpoint.keep_every=-1 must be >= 0"),
        ("trainer.early_stop.patience=-2", "trainer.early_stop.patience: must be >= 0, got -2"),
        ("trainer.early_stop.min_delta=-0.5", "trainer.early_stop.min_delta: must be >= 0, got -0.5"),
        # an early stop that can never stop: accepted, it was a silent no-op
        ("trainer.early_stop.patience=2 trainer.eval_every=0", "trainer.early_stop.patience=2: trainer.eval_every=0 "
         "evaluates only after the last step; early stop could never stop the run (set trainer.eval_every=N, N < trainer.steps)"),
        ("trainer.early_stop.patience=2", "trainer.early_stop.patience=2: trainer.eval_every=10 evaluates 1 time before "
         "the last of trainer.steps=20; early stop needs 3 (a first, then 2 without improvement), so it could never "
         "stop the run"),  # every 10 of 20 steps
    ],
)
def test_bad_kept_checkpoint_and_early_stop_values_are_one_line(tmp_path, arg, message):
    result = run_cli(*arg.split(), "dry_run=true", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"tinker_exp: config error: {message}"]


def test_early_stop_with_evaluations_before_the_last_step_is_accepted(tmp_path):
    """The fix the line names: trainer.eval_every=5 of 20 steps evaluates 3 times before the last (5, 10, 15)."""
    result = run_cli("trainer.early_stop.patience=2", "trainer.eval_every=5", "dry_run=true", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0 and (tmp_path / "plan.json").is_file(), result.stderr


def test_differing_names_each_key_and_skips_keys_the_schema_gained_since():
    saved = {"trainer": {"steps": 8, "seed": 0}, "override": None}
    now = {"trainer": {"steps": 8, "seed": 1, "early_stop": {"patience": 0}}, "override": {"lr": 1e-3}}
    assert differing(saved, now, lambda key: True) == ["override.lr: null -> 0.001", "trainer.seed: 0 -> 1"]
    assert differing(saved, now, lambda key: key.startswith("trainer.")) == ["trainer.seed: 0 -> 1"]


def test_the_wsd_branch_preset_composes_each_branch_and_needs_a_trunk(trunk, tmp_path):
    cfg = config.load(compose("branch_sweep=wsd_decay", f"branch.from={trunk}", "branch.step=12"))
    assert cfg.trainer.steps == 18 and cfg.override["lr"]["schedule"] == "wsd" and cfg.branch.step == 12
    # its launcher: local processes (a real sweep of its branches runs on Slurm: test_branch_ray.py)
    assert compose("branch_sweep=wsd_decay", with_hydra=True).hydra.launcher._target_.endswith("LocalSweepLauncher")
    result = run_cli("branch_sweep=wsd_decay", "dry_run=true", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "tinker_exp: config error: branch.step=6 needs branch.from=<run dir> (the run to branch from)"
    ]
