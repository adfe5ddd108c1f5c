"""Real runs: verl TinkerTrainingWorkers (FSDP2) on Ray CPU gloo workers, sharing one Ray cluster: 2 where a test
holds every rank (the constant run, a drifting rank 1), 1 where it claims nothing of ranks."""

import json
import os
from pathlib import Path

import pytest

from helpers import (
    compose,
    metrics_rows,
    planned,
    read_jsonl,
    run_cli,
    start_cli,
    wandb_finished_records,
    wandb_history,
    wait_until,
)
from tinker_exp.errors import AppliedMismatchError
from tinker_exp.train.loop import check_applied
from tinker_exp.place import GivenWorkers
from tinker_exp.run import run

SECRET = "tinker-exp-test-secret-0123456789abcdef"
STEPS = 8


@pytest.fixture(scope="module")
def constant_run(ray_address, tmp_path_factory):
    """One 8-step run with a constant override from YAML ints and lists; a W&B key sits in the env."""
    run_dir = tmp_path_factory.mktemp("constant_run")
    overrides = [
        "+override=constant", "override.lr=5e-4", "override.weight_decay=0", "override.betas=[0.9,0.95]",
        f"trainer.steps={STEPS}", "checkpoint.sha256=true",
    ]  # fmt: skip
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


def expected_values() -> dict[str, float]:
    """What constant_run sends: every key differs from the optimizer's own value (lr 1e-3, beta2 0.999,
    weight_decay 0.01), eps aside."""
    return {"lr": 5e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0}


def test_applied_equals_requested_every_step(constant_run):
    run_dir, _ = constant_run
    expected = expected_values()
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
    # The config: one flat key per value (W&B's parallel coordinates and grouping work on keys)
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert config["hydra_choices.override"] == "constant" and config["trainer.steps"] == STEPS
    sent = {"lr": 5e-4, "betas.0": 0.9, "betas.1": 0.95, "eps": 1e-8, "weight_decay": 0.0}  # plain values: constants
    assert {key: value for key, value in config.items() if key.startswith("override.")} == {
        **{f"override.{key}.schedule": "constant" for key in sent}, **{f"override.{key}.value": v for key, v in sent.items()}
    }
    assert all(not isinstance(value, (dict, list)) or value in ({}, []) for value in config.values())
    # The history: only what a person charts, plus the step metric and the plan's plot (an image, once)
    history = wandb_history(records)
    assert {key for row in history for key in row if not key.startswith(("_", "plan/plot/"))} == {
        "train/step", "train/loss", "train/grad_norm", "perf/step_time_s", "perf/tokens_per_s", "val/loss",
        "perf/eval_time_s", *(f"{kind}/{key}" for kind in ("requested", "applied") for key in expected_values()),
    }  # no `time` (W&B keeps _timestamp), no plan/table.* (its row and column counts would be charts)
    assert [row["plan/plot/_type"] for row in history if "plan/plot/_type" in row] == ["image-file"]
    summaries = [r.summary for r in records if r.WhichOneof("record_type") == "summary"]
    assert {"plan/table", "val/tokens", "train/nonfinite_steps"} <= {u.key for s in summaries for u in s.update}
    history = [row for row in history if "train/loss" in row]
    jsonl = read_jsonl(run_dir / "metrics.jsonl")
    assert len(history) == len(jsonl) == STEPS and all("time" in row for row in jsonl)  # metrics.jsonl keeps it
    for logged, row in zip(history, jsonl):
        for key in ("train/step", "train/loss", "requested/lr", "applied/lr", "applied/beta2", "applied/weight_decay"):
            assert logged[key] == pytest.approx(row[key], rel=1e-12)
    metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "*" and m.step_metric == "train/step" for m in metrics)
    assert any(m.name == "train/step" and m.options.hidden for m in metrics)  # the x axis, no chart of its own


def test_no_secret_in_logs_or_saved_configs(constant_run):
    run_dir, _ = constant_run
    for path in Path(run_dir).rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"W&B API key written to {path}"


def test_resolved_config_is_saved(constant_run):
    import yaml

    run_dir, _ = constant_run
    text = (run_dir / "config.yaml").read_text()
    saved = yaml.safe_load(text)
    assert "${" not in text
    assert saved["override"]["weight_decay"] == 0 and saved["override"]["lr"] == 5e-4  # what was asked for
    assert saved["optimizer"]["weight_decay"] == 0.01 and saved["trainer"]["steps"] == STEPS  # the rest as composed


def test_a_real_run_with_sha256_writes_every_files_hash(constant_run):
    import hashlib

    run_dir, _ = constant_run
    (checkpoint,) = sorted((run_dir / "checkpoints").glob("step_*"))[-1:]
    files = json.loads((checkpoint / "MANIFEST.json").read_text())["files"]
    shards = [name for name in files if name.startswith("workers/") and name.endswith(".pt")]
    assert len(shards) >= 4, files  # model and optimizer of both ranks
    for name, entry in files.items():
        assert entry["sha256"] == hashlib.sha256((checkpoint / name).read_bytes()).hexdigest(), name


@pytest.mark.parametrize("rank, group", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_applied_check_covers_every_rank_and_group(rank, group):
    requested = {"lr": 1e-3, "betas": (0.9, 0.95)}
    good = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8}
    assert check_applied(0, requested, [[good, good], [good, good]]) == good
    for bad, key in (({**good, "lr": 2e-3}, "lr"), ({**good, "betas": [0.9, 0.95]}, "betas"), ({**good, "lr": 1}, "lr")):
        applied = [[dict(good), dict(good)], [dict(good), dict(good)]]
        applied[rank][group] = bad
        with pytest.raises(AppliedMismatchError, match=rf"^step 7: rank {rank} param group {group} holds {key}="):
            check_applied(7, requested, applied)


def test_cli_trains_through_ray_with_a_quiet_terminal(cosine_trunk):
    """The suite's shared CLI run (conftest.py: 12 steps of a cosine lr, W&B offline) through the shared Ray cluster."""
    tmp_path, result = cosine_trunk
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["requested/lr"] for row in rows] == [row["applied/lr"] for row in rows] == planned(tmp_path, "lr")
    assert len(set(planned(tmp_path, "lr"))) > 1
    # The terminal: the plan, where the worker output went, one line per checkpoint, a summary; no worker chatter.
    assert result.stdout.startswith(f"worker output: {tmp_path / 'workers.log'}")
    assert f"checkpoint: {tmp_path / 'checkpoints' / 'step_00000012'}" in result.stdout
    assert "done: 12 steps, final loss" in result.stdout
    assert "pid=" not in result.stdout + result.stderr and "engine is not available" not in result.stderr
    # ... it is all in the run dir: every rank's start-up warnings, complete
    workers_log = (tmp_path / "workers.log").read_text()
    assert workers_log.count("UserWarning: torchtitan engine is not available") == 2, workers_log[-3000:]  # one per rank
    assert "(TinkerExpWorker pid=" in workers_log
    assert "checkpoint: " in (tmp_path / "tinker_exp.log").read_text()


def test_sigterm_stops_the_run_cleanly(ray_address, tmp_path):
    """SIGTERM to the driver (kill, a supervisor): the loop stops, workers are freed, the W&B run is finished."""
    import signal

    driver = start_cli("trainer.steps=1000", "backend.num_workers=1", f"hydra.run.dir={tmp_path}", env={"RAY_ADDRESS": ray_address})
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
    records = wandb_finished_records(tmp_path)  # the service may write the exit record a moment later
    assert [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"] == [143]
    logged = [row for row in wandb_history(records) if "train/loss" in row]
    assert len(logged) == len(rows)


def test_a_group_that_does_not_hold_what_was_sent_stops_the_run_with_exit_3(ray_address, tmp_path):
    """verl applies what it is sent; a test-only worker alters one group on rank 1 after step 2's update."""
    from tinker_exp.errors import AppliedMismatchError as Mismatch
    from tinker_exp.runtime.workers import TinkerWorkers

    class DriftingWorkers(TinkerWorkers):
        def worker_class(self):
            base = super().worker_class()
            from verl.single_controller.base.decorator import Dispatch, register

            class DriftingWorker(base):  # a local class: Ray ships it to the workers by value
                @register(dispatch_mode=Dispatch.ONE_TO_ALL)
                def optimizer_step(self, optim_step_params=None):
                    import torch.distributed as dist
                    from verl.workers.engine_workers_tinker import _iter_optimizer_param_groups

                    result = base.optimizer_step(self, optim_step_params=optim_step_params)
                    self.steps_done = getattr(self, "steps_done", 0) + 1
                    if dist.get_rank() == 1 and self.steps_done == 3:
                        groups = list(_iter_optimizer_param_groups(self.engine.optimizer))
                        groups[-1]["lr"] = 7e-4
                        result["param_groups"] = self._param_group_values()
                    return result

            return DriftingWorker

    def start(cfg, plan, model_path, run_dir):
        return DriftingWorkers(cfg.backend, cfg.optimizer, cfg.trainer, str(model_path), plan.optimizer_values, "cpu")

    with pytest.raises(Mismatch, match=r"^step 2: rank 1 param group \d+ holds lr=0.0007, but 0.0005 was requested$") as info:
        run(compose("+override.lr=5e-4", "trainer.steps=5", "logger=none"), tmp_path, place=GivenWorkers(start))
    assert info.value.exit_code == 3  # what the CLI exits with (tinker_exp.errors; one line, as every stop)
    assert [row["train/step"] for row in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]


@pytest.fixture(scope="module")
def three_step_losses(ray_address, tmp_path_factory):
    """Three short real runs from the same init and data: no override, then one key at a time."""

    def losses(*overrides: str) -> list[float]:
        run_dir = tmp_path_factory.mktemp("update")
        run(compose(*overrides, "trainer.steps=3", "backend.num_workers=1", "logger=none", "checkpoint.every_steps=0", "checkpoint.at_end=false"), run_dir)
        rows = read_jsonl(run_dir / "metrics.jsonl")
        assert len(rows) == 3
        return [row["train/loss"] for row in rows]

    return losses, losses()


@pytest.mark.parametrize("override", ["+override.betas=[0.5,0.9]", "+override.eps=0.1", "+override.weight_decay=20.0"])
def test_betas_eps_and_weight_decay_overrides_change_the_update(three_step_losses, override):
    losses, baseline = three_step_losses
    changed = losses(override)
    assert changed[0] == baseline[0]  # the same model and batch before any update
    # Adam's first update is g/|g| whatever the betas (bias correction); by the second, each value has acted
    assert changed[2] != baseline[2]


def test_evaluation_between_steps_leaves_training_bitwise_unchanged(ray_address, tmp_path):
    """verl's infer_batch (eval mode, no_grad) after every step vs only after the last: the same training."""
    common = ["+override=lr_cosine", "trainer.steps=4", "backend.num_workers=1", "logger=none", "checkpoint.every_steps=0", "checkpoint.at_end=false"]
    run(compose(*common, "trainer.eval_every=1"), tmp_path / "every")
    run(compose(*common, "trainer.eval_every=0"), tmp_path / "last")
    every, last = read_jsonl(tmp_path / "every" / "metrics.jsonl"), read_jsonl(tmp_path / "last" / "metrics.jsonl")
    keys = ("train/loss", "train/grad_norm", "applied/lr", "applied/beta2")
    assert [[row[k] for k in keys] for row in every] == [[row[k] for k in keys] for row in last]
    assert [("val/loss" in row) for row in every] == [True] * 4 and [("val/loss" in row) for row in last] == [False] * 3 + [True]
    assert every[-1]["val/loss"] == last[-1]["val/loss"]  # the same weights, the same validation loss
    assert every[-1]["val/loss"] < every[0]["val/loss"]  # and it falls as the model trains


def test_the_validation_loss_is_token_weighted_over_the_whole_set(ray_address, tmp_path):
    """With lr 0 the weights never move: batches of 8 or of 4 must give the same loss over the same validation
    tokens (a mean of per-batch means would not: the batches hold different numbers of tokens)."""
    common = ["+override.lr=0", "trainer.steps=1", "backend.num_workers=1", "logger=none", "checkpoint.at_end=false"]
    run(compose(*common, "trainer.batch_size=8"), tmp_path / "eight")
    run(compose(*common, "trainer.batch_size=4"), tmp_path / "four")
    eight, four = read_jsonl(tmp_path / "eight" / "metrics.jsonl")[-1], read_jsonl(tmp_path / "four" / "metrics.jsonl")[-1]
    assert eight["val/tokens"] == four["val/tokens"] > 0
    assert eight["val/loss"] == pytest.approx(four["val/loss"], rel=1e-6)  # fp32 sums in another order
