"""Validation data, evaluation between steps and the run's objective: bookkeeping with FakeWorkers, pure parts.

The real forward-only path (verl's infer_batch) is tested in test_train_e2e: training bitwise unchanged by
evaluation, and the loss token-weighted over the whole set whatever the batching.
"""

from __future__ import annotations

import pytest

from fakes import fake_workers
from helpers import compose, metrics_rows, run_cli
from tinker_exp import config
from tinker_exp.errors import ConfigError
from tinker_exp.place import GivenWorkers
from tinker_exp.run import objective, run, validate
from tinker_exp.sweep.jobs import JobOutcome, summary_table
from tinker_exp.train.data import Example, dataset_rows, eval_batches
from tinker_exp.train.objective import objective_value


def typed(*overrides: str):
    return config.load(compose(*overrides))


def test_the_shipped_data_holds_out_a_seeded_validation_split():
    train, val = dataset_rows(typed().data)
    key = lambda rows: {r.identity for r in rows}  # noqa: E731
    assert len(key(val)) == round(0.1 * len(key(train) | key(val))) > 0  # a tenth of the distinct rows
    assert not key(train) & key(val)  # disjoint: a row repeated in the file goes to one side with all its copies
    assert dataset_rows(typed("trainer.seed=7").data) == (train, val)  # a sweep over training seeds keeps it
    assert dataset_rows(typed("data.split_seed=1").data)[1] != val
    everything, none = dataset_rows(typed("data.val_fraction=null").data)
    assert none == [] and key(everything) == key(train) | key(val)


def test_a_validation_file_replaces_the_split(tmp_path):
    val_file = tmp_path / "val.jsonl"
    val_file.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"}\n')
    train, val = dataset_rows(typed(f"data.val_path={val_file}").data)
    assert [(r.prompt, r.response) for r in val] == [("a", "b"), ("c", "d")] and len(train) > 100
    assert [r.where for r in val] == [f"data.val_path: {val_file}:1", f"data.val_path: {val_file}:2"]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "a"}\n', "data.val_path: {path}:1: missing string field 'response'"),
        ("not json\n", "data.val_path: {path}:1: not valid JSON"),
        ("[1, 2]\n", "data.val_path: {path}:1: expected a JSON object, got list"),
        ("\n", "data.val_path: {path} has no rows"),
        ("", "data.val_path: {path} is empty"),
    ],
)
def test_a_bad_validation_file_is_a_config_error_naming_the_key(tmp_path, content, message):
    val_file = tmp_path / "val.jsonl"
    val_file.write_text(content)
    with pytest.raises(ConfigError, match="^" + message.format(path=val_file).replace("[", r"\[")):
        dataset_rows(typed(f"data.val_path={val_file}").data)


def test_a_split_that_leaves_no_validation_row_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^data.val_fraction: 0.001 of \d+ rows leaves \d+ for training and 0 for validation"):
        dataset_rows(typed("data.val_fraction=0.001").data)


def test_an_objective_that_is_never_logged_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^trainer.objective: 'val/loss' is never logged \(there is no validation data\)"):
        validate(typed("data.val_fraction=null", "trainer.objective=val/loss"))
    with pytest.raises(ConfigError, match=r"^trainer.objective: 'val/los' is never logged"):
        validate(typed("trainer.objective=val/los"))


def test_validation_batches_split_like_training_batches_and_fillers_carry_no_tokens():
    examples = [Example([1, 2, 3, 4][: n + 1], [0] + [1] * n) for n in range(1, 4)] * 3  # 9 examples
    batches = eval_batches(examples, 4)
    assert [len(b) for b in batches] == [4, 4, 4]
    assert sum(sum(e.loss_mask) for b in batches for e in b) == sum(sum(e.loss_mask) for e in examples)


def test_evaluation_rows_every_n_steps_and_after_the_last(tmp_path):
    start = fake_workers()
    run(compose("trainer.steps=7", "trainer.eval_every=3", "logger=none"), tmp_path, place=GivenWorkers(start))
    rows = metrics_rows(tmp_path)
    assert [row["train/step"] for row in rows if "val/loss" in row] == [2, 5, 6]  # after 3 and 6 steps, and the last
    _, val = dataset_rows(typed().data)
    assert {row["val/tokens"] for row in rows if "val/tokens" in row} == {rows[2]["val/tokens"]} and rows[2]["val/tokens"] > 0
    # each evaluation went over every validation batch
    assert start.started[0].evaluations == 3 * len(eval_batches([Example([0], [1])] * len(val), 8))


def test_no_validation_data_means_no_evaluation_and_train_loss_as_objective(tmp_path):
    start = fake_workers()
    run(compose("trainer.steps=4", "data.val_fraction=null", "logger=none"), tmp_path, place=GivenWorkers(start))
    assert start.started[0].evaluations == 0 and not any("val/loss" in row for row in metrics_rows(tmp_path))
    cfg = typed("trainer.steps=4", "data.val_fraction=null")
    assert objective(cfg, tmp_path) == metrics_rows(tmp_path)[-1]["train/loss"]


def test_the_objective_is_the_last_or_lowest_value_of_its_metric(tmp_path):
    run(compose("trainer.steps=6", "trainer.eval_every=2", "logger=none"), tmp_path, place=GivenWorkers(fake_workers()))
    vals = [row["val/loss"] for row in metrics_rows(tmp_path) if "val/loss" in row]
    assert len(vals) == 3
    assert objective(typed(), tmp_path) == vals[-1]
    assert objective(typed("trainer.objective_mode=min"), tmp_path) == min(vals)
    assert objective(typed("trainer.objective=train/grad_norm"), tmp_path) == metrics_rows(tmp_path)[-1]["train/grad_norm"]
    assert objective_value([{"a": 3.0}, {"b": 1.0}, {"a": 2.0}], "a", "min") == 2.0
    assert objective_value([{"b": 1.0}], "a", "last") is None


def test_a_resumed_run_has_every_evaluation_row_once(tmp_path):
    common = ["trainer.steps=8", "trainer.eval_every=2", "checkpoint.every_steps=4", "logger=none"]
    run(compose(*common), tmp_path, place=GivenWorkers(fake_workers()))
    (tmp_path / "checkpoints" / "step_00000008").rename(tmp_path / "elsewhere")  # as if killed before saving step 8
    run(compose(*common), tmp_path, place=GivenWorkers(fake_workers()))
    rows = metrics_rows(tmp_path)
    assert [row["train/step"] for row in rows] == list(range(8))
    assert [row["train/step"] for row in rows if "val/loss" in row] == [1, 3, 5, 7]


def test_the_sweep_summary_is_sorted_by_objective_with_the_best_marked():
    outcomes = [
        JobOutcome(0, ["a"], "COMPLETED", "d0", objective=2.5),
        JobOutcome(1, ["b"], "FAILED", "d1", error="x"),
        JobOutcome(2, ["c"], "COMPLETED", "d2", objective=1.25),
    ]
    lines = summary_table(outcomes).splitlines()
    assert "objective" in lines[0]
    assert [line.split()[0] for line in lines[2:]] == ["*2", "0", "1"]
    assert "1.2500" in lines[2] and "2.5000" in lines[3]


def test_bad_validation_settings_fail_the_cli_in_one_line(tmp_path):
    result = run_cli("data.val_fraction=1.5", "dry_run=true", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["tinker_exp: config error: data.val_fraction: 1.5 is not in (0, 1) (null: no validation)"]


def test_a_run_and_a_sweep_get_a_report_picture(tmp_path):
    from tinker_exp.sweep.report import write_report

    for name, override in (("cosine", "+override=lr_cosine"), ("wsd", "+override=lr_wsd")):
        run(compose(override, "trainer.steps=12", "trainer.eval_every=4", "logger=none"), tmp_path / name, place=GivenWorkers(fake_workers()))
        assert (tmp_path / name / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # every run gets one
    sweep = write_report([("cosine", tmp_path / "cosine"), ("wsd", tmp_path / "wsd")], tmp_path / "report.png", "sweep")
    assert sweep == tmp_path / "report.png" and sweep.stat().st_size > 10_000
    assert write_report([("empty", tmp_path / "nothing")], tmp_path / "none.png", "nothing") is None  # nothing logged


def test_a_report_whose_plan_cannot_be_rebuilt_says_so_and_draws_the_losses(tmp_path):
    from tinker_exp.sweep import report

    run(compose("+override=lr_cosine", "trainer.steps=6", "logger=none"), tmp_path, place=GivenWorkers(fake_workers()))
    assert set(report._plan(tmp_path).columns) == {"lr"}  # the plan's panels come from plan.json
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan_file.read_text().replace('"min_ratio": 0.1', '"min_ratio": 0.5'))  # not the run's plan
    with pytest.warns(UserWarning, match=r"report: no plan panels for .*: ValueError: .*plan.json: step \d+: lr is"):
        assert report.write_report([("run", tmp_path)], tmp_path / "again.png", "run") == tmp_path / "again.png"
