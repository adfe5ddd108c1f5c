"""The logger group's sinks (metrics.csv, TensorBoard) on a stream of rows as the loop logs them, read back with each
tool's own reader; then one real run with both, checkpointed and resumed, against its metrics.jsonl.

No workers in the bookkeeping tests: a sink sees only rows (tinker_exp/train/sinks.py).
"""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path

import pytest

from fakes import fake_workers
from helpers import compose, metrics_rows, read_jsonl
from tinker_exp.place import GivenWorkers
from tinker_exp.run import run
from tinker_exp.train.sinks import TENSORBOARD_DROPPED, CsvSink, JsonlSink, Sinks, TensorBoardSink


def row(step: int) -> dict:
    """A step's row as the loop logs it: requested and applied values, losses, perf; val/* at every third step."""
    logged = {"train/step": step, "time": 1700000000.5 + step, "train/loss": 4.0 / (step + 1), "train/grad_norm": 1.5,
              "train/nonfinite_steps": 0, "requested/lr": 1e-3 * (step + 1), "applied/lr": 1e-3 * (step + 1),
              "applied/beta2": 0.999, "perf/step_time_s": 0.25, "perf/tokens_per_s": 1234.5}  # fmt: skip
    if step % 3 == 2:  # keys first logged at the first evaluation
        logged.update({"val/loss": 3.0 / (step + 1), "val/tokens": 640, "perf/eval_time_s": 0.5})
    return logged


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="", encoding="utf-8") as file:
        reader = csv.DictReader(file)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def same_as_csv(logged: dict, read: dict[str, str], columns: list[str]) -> None:
    """Each logged value is its cell (floats exactly, as repr writes them); a key the row lacks is an empty cell."""
    for key in columns:
        if key in logged:
            assert float(read[key]) == logged[key], (key, read[key], logged[key])
        else:
            assert read[key] == "", (key, read)


def test_metrics_csv_holds_every_row_under_the_union_of_keys(tmp_path):
    sink = CsvSink(tmp_path / "metrics.csv")
    for step in range(7):
        sink.log(row(step))
    sink.close()
    columns, read = read_csv(tmp_path / "metrics.csv")
    assert columns[0] == "train/step" and set(columns) == set(row(2))  # val/* joined the header at step 2
    assert [int(r["train/step"]) for r in read] == list(range(7))
    for step, cells in enumerate(read):
        assert None not in cells and None not in cells.values()  # every row has exactly the header's columns
        same_as_csv(row(step), cells, columns)
    assert not list(tmp_path.glob("*.tmp"))


def test_a_resumed_metrics_csv_drops_the_steps_it_trains_again_and_keeps_its_header(tmp_path):
    """As metrics.jsonl: a run killed after step 5 (its last checkpoint at 4 steps done) resumes at step 4."""
    killed = CsvSink(tmp_path / "metrics.csv")
    for step in range(6):
        killed.log(row(step))
    with open(tmp_path / "metrics.csv", "a", encoding="utf-8") as file:
        file.write("6,17000")  # the kill cut a row short
    resumed = CsvSink(tmp_path / "metrics.csv", first_step=4)
    for step in range(4, 9):
        resumed.log(row(step))
    resumed.close()
    columns, read = read_csv(tmp_path / "metrics.csv")
    assert [int(r["train/step"]) for r in read] == list(range(9))
    for step, cells in enumerate(read):
        same_as_csv(row(step), cells, columns)


@pytest.mark.parametrize("kind", ["csv", "tensorboard"])
def test_a_sink_that_fails_warns_once_and_training_and_the_other_sinks_go_on(kind, tmp_path):
    """metrics.csv in a folder that does not exist, TensorBoard's folder under a file: every write fails."""
    (tmp_path / "a_file").write_text("")
    failing, warned = {
        "csv": (lambda: CsvSink(tmp_path / "gone" / "metrics.csv"), "metrics.csv stopped working"),
        "tensorboard": (lambda: TensorBoardSink(tmp_path / "a_file" / "tensorboard", CONFIG), "TensorBoard stopped working"),
    }[kind]
    sinks = Sinks([failing(), JsonlSink(tmp_path / "metrics.jsonl")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            sinks.log(row(step))
        sinks.close(0)
    assert [str(w.message).split(" (")[0] for w in caught] == [warned]
    assert [r["train/step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(4))



def read_tensorboard(folder: Path):
    """TensorBoard's own reader on the folder (every event file in it, in order, as `tensorboard --logdir` reads)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0}).Reload()


def same_as_tensorboard(logged: list[dict], accumulator) -> None:
    """Each numeric key of each row is a scalar at its train/step (float32, as TensorBoard keeps scalars), in order."""
    tags = {key for row in logged for key in row if key not in TENSORBOARD_DROPPED}
    assert set(accumulator.Tags()["scalars"]) == tags
    for tag in tags:
        expected = [(row["train/step"], row[tag]) for row in logged if tag in row]
        read = [(event.step, event.value) for event in accumulator.Scalars(tag)]
        assert [step for step, _ in read] == [step for step, _ in expected], tag
        assert all(math.isclose(value, want, rel_tol=1e-6) for (_, value), (_, want) in zip(read, expected)), tag


CONFIG = {"trainer.steps": 9, "optimizer.name": "AdamW", "optimizer.betas.1": 0.999, "lora.target_modules": [], "env.name": None,
          "backend.padding_free": True}  # fmt: skip


def test_tensorboard_holds_every_rows_scalars_at_its_step_and_the_config(tmp_path):
    sink = TensorBoardSink(tmp_path / "tensorboard", CONFIG)
    for step in range(7):
        sink.log(row(step))
    sink.close()
    accumulator = read_tensorboard(tmp_path / "tensorboard")
    same_as_tensorboard([row(step) for step in range(7)], accumulator)
    assert [event.wall_time for event in accumulator.Scalars("train/loss")] == [row(step)["time"] for step in range(7)]
    (text,) = accumulator.Tensors("config")
    assert "| optimizer.name | \"AdamW\" |" in text.tensor_proto.string_val[0].decode()
    from tensorboard.plugins.hparams import metadata
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    content = accumulator.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]
    hparams = HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["trainer.steps"].number_value == 9 and hparams["optimizer.name"].string_value == "AdamW"
    assert hparams["backend.padding_free"].bool_value is True and "env.name" not in hparams


def test_a_resumed_tensorboard_run_reads_back_each_step_once(tmp_path):
    """A run killed after step 5 (its writer never closed: each row is flushed as logged) resumes at step 4 in a file
    of its own."""
    killed = TensorBoardSink(tmp_path / "tensorboard", CONFIG)
    for step in range(6):
        killed.log(row(step))
    resumed = TensorBoardSink(tmp_path / "tensorboard", CONFIG, first_step=4)
    for step in range(4, 9):
        resumed.log({**row(step), "train/loss": 10.0 + step})  # the steps trained again log other values
    resumed.close()
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    same_as_tensorboard([row(step) for step in range(4)] + [{**row(step), "train/loss": 10.0 + step} for step in range(4, 9)],
                        read_tensorboard(tmp_path / "tensorboard"))  # fmt: skip


def test_a_list_of_loggers_writes_each_with_metrics_jsonls_rows(tmp_path):
    """Through the run's entry (fake workers): logger=[csv,tensorboard] composes both (Hydra's list of a group's
    options) and starts no W&B; each holds metrics.jsonl's rows."""
    run(compose("logger=[csv,tensorboard]", "trainer.steps=4", "trainer.eval_every=2"), tmp_path, place=GivenWorkers(fake_workers()))
    logged = metrics_rows(tmp_path)
    columns, read = read_csv(tmp_path / "metrics.csv")
    assert len(read) == len(logged) == 4 and "val/loss" in columns
    for expected, cells in zip(logged, read):
        same_as_csv(expected, cells, columns)
    same_as_tensorboard(logged, read_tensorboard(tmp_path / "tensorboard"))
    assert not (tmp_path / "wandb").exists()
