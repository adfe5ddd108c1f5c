"""Real runs: verl TinkerTrainingWorkers (FSDP2) on 2 Ray CPU gloo workers, sharing one Ray cluster."""

import json
import os
from pathlib import Path

import pytest

from helpers import (
    REPO,
    compose,
    environment,
    metrics_rows,
    read_jsonl,
    run_cli,
    wandb_finished_records,
    wandb_history,
    wandb_records,
    wandb_run_file,
    wait_until,
)
from tinker_exp.errors import AppliedMismatchError
from tinker_exp.train.loop import check_applied
from tinker_exp.main import run

SECRET = "tinker-exp-test-secret-0123456789abcdef"
STEPS = 8


@pytest.fixture(scope="module")
def constant_run(ray_address, tmp_path_factory):
    """One 8-step run with a constant override from YAML ints and lists; a W&B key sits in the env."""
    run_dir = tmp_path_factory.mktemp("constant_run")
    overrides = ["+override=constant", "override.weight_decay=0", "override.betas=[0.9,0.95]", f"trainer.steps={STEPS}"]
    os.environ["WANDB_API_KEY"] = SECRET
    try:
        last = run(compose(*overrides), run_dir, choices={"override": "constant"})
    finally:
        del os.environ["WANDB_API_KEY"]
    return run_dir, last


def test_loss_falls_and_every_step_is_logged(constant_run):
    run_dir, last = constant_run
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["train/step"] for row in rows] == list(range(STEPS))
    assert rows[-1] == last
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.1
    assert all(row["perf/tokens_per_s"] > 0 and row["train/grad_norm"] > 0 for row in rows)


def test_applied_equals_requested_every_step(constant_run):
    run_dir, _ = constant_run
    expected = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0}
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        for key, value in expected.items():
            assert row[f"requested/{key}"] == value
            assert row[f"applied/{key}"] == value


def test_wandb_offline_run_file_holds_the_same_values(constant_run):
    run_dir, _ = constant_run
    records = wandb_finished_records(run_dir)
    kinds = [record.WhichOneof("record_type") for record in records]
    assert "exit" in kinds and records[kinds.index("exit")].exit.exit_code == 0
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: item.value_json for item in run_record.config.update}
    assert json.loads(config["hydra_choices"]) == {"override": "constant"}
    assert json.loads(config["trainer"])["steps"] == STEPS
    history = wandb_history(records)
    plan_rows = [row for row in history if any(key.startswith("plan/table") for key in row)]
    assert len(plan_rows) == 1 and any(key.startswith("plan/plot") for key in plan_rows[0])  # attached once
    history = [row for row in history if "train/loss" in row]
    jsonl = read_jsonl(run_dir / "metrics.jsonl")
    assert len(history) == len(jsonl) == STEPS
    for logged, row in zip(history, jsonl):
        for key in ("train/step", "train/loss", "requested/lr", "applied/lr", "applied/beta2", "applied/weight_decay"):
            assert logged[key] == pytest.approx(row[key], rel=1e-12)
    metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "*" and m.step_metric == "train/step" for m in metrics)


def test_no_secret_in_logs_or_saved_configs(constant_run):
    run_dir, _ = constant_run
    for path in Path(run_dir).rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"W&B API key written to {path}"


def test_resolved_config_is_saved(constant_run):
    run_dir, _ = constant_run
    text = (run_dir / "config.yaml").read_text()
    assert "${" not in text and "weight_decay: 0.0" in text


def test_applied_check_covers_every_rank_and_group():
    requested = {"lr": 1e-3, "betas": (0.9, 0.95)}
    good = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8}
    assert check_applied(0, requested, [[good, good], [good, good]]) == good
    for bad in ({**good, "lr": 2e-3}, {**good, "betas": [0.9, 0.95]}, {**good, "lr": 1}):
        with pytest.raises(AppliedMismatchError, match=r"step 7: rank 1 param group 1"):
            check_applied(7, requested, [[good, good], [good, bad]])


def test_cli_trains_through_ray_with_a_quiet_terminal(ray_address, tmp_path):
    result = run_cli(
        "+override.lr=5e-4", "trainer.steps=3", "logger=none", f"hydra.run.dir={tmp_path}",
        env={"RAY_ADDRESS": ray_address},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["requested/lr"] for row in rows] == [5e-4] * 3
    assert [row["applied/lr"] for row in rows] == [5e-4] * 3
    # The terminal: the plan, where the worker output went, one line per checkpoint, a summary; no worker chatter.
    assert result.stdout.startswith(f"worker output: {tmp_path / 'workers.log'}")
    assert f"checkpoint: {tmp_path / 'checkpoints' / 'step_00000003'}" in result.stdout
    assert "done: 3 steps, final loss" in result.stdout
    assert "pid=" not in result.stdout + result.stderr and "engine is not available" not in result.stderr
    # ... it is all in the run dir: every rank's start-up warnings, complete
    workers_log = (tmp_path / "workers.log").read_text()
    assert workers_log.count("UserWarning: torchtitan engine is not available") == 2, workers_log[-3000:]  # one per rank
    assert "(TinkerExpWorker pid=" in workers_log
    assert "checkpoint: " in (tmp_path / "tinker_exp.log").read_text()


def test_sigterm_stops_the_run_cleanly(ray_address, tmp_path):
    """SIGTERM to the driver (kill, a supervisor): the loop stops, workers are freed, the W&B run is finished."""
    import signal
    import subprocess
    import sys

    driver = subprocess.Popen(
        [sys.executable, "-m", "tinker_exp", "trainer.steps=1000", f"hydra.run.dir={tmp_path}"],
        cwd=REPO, env=environment({"RAY_ADDRESS": ray_address}), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: len(metrics_rows(tmp_path)) >= 2, 180, "training never started", driver)
        driver.send_signal(signal.SIGTERM)
        _, stderr = driver.communicate(timeout=120)
    finally:
        driver.kill()
    assert driver.returncode == 143, stderr[-3000:]
    assert "tinker_exp: stopped: terminated by SIGTERM" in stderr
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert 2 <= len(rows) < 1000 and [row["train/step"] for row in rows] == list(range(len(rows)))
    records = wandb_records(wandb_run_file(tmp_path))
    assert [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"] == [143]
    logged = [row for row in wandb_history(records) if "train/loss" in row]
    assert len(logged) == len(rows)
