"""Checkpoint files (pure): atomic saves, failure injection, corrupt checkpoints, rotation, resume modes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tinker_exp.train.checkpoints import (
    MANIFEST,
    WORKERS,
    Checkpointer,
    ResumePoint,
    begin_save,
    check_checkpoint_device,
    commit_save,
    latest,
    problem,
    resume_point,
    rotate,
    saved_steps,
    step_dir,
)
from tinker_exp.config import CheckpointConfig
from tinker_exp.errors import CheckpointError, ConfigError
from tinker_exp.train.sinks import keep_rows_before


class FakeShardWriter:
    """Stands in for the worker group: writes one file per rank, as verl's save_checkpoint does."""

    def __init__(self, ranks: int = 2):
        self.ranks = ranks

    def save_checkpoint(self, folder: Path, step: int) -> None:
        for rank in range(self.ranks):
            (folder / f"model_world_size_{self.ranks}_rank_{rank}.pt").write_bytes(bytes([step % 256]) * (100 + rank))


def save(root: Path, step: int, hashes: bool = False) -> Path:
    tmp = begin_save(root, step)
    FakeShardWriter().save_checkpoint(tmp / WORKERS, step)
    return commit_save(tmp, step, {"seed": 0, "nonfinite_steps": 0}, hashes=hashes)


def test_a_committed_checkpoint_is_complete_and_found(tmp_path):
    path = save(tmp_path, 4)
    assert path == step_dir(tmp_path, 4) and problem(path) is None
    point = latest(tmp_path)
    assert point.path == path and point.step == 4 and point.state["seed"] == 0 and point.skipped == []
    manifest = json.loads((path / MANIFEST).read_text())["files"]
    assert set(manifest) == {"loop.json", f"{WORKERS}/model_world_size_2_rank_0.pt", f"{WORKERS}/model_world_size_2_rank_1.pt"}


def test_a_crash_while_saving_never_leaves_a_checkpoint_that_looks_complete(tmp_path):
    save(tmp_path, 4)
    tmp = begin_save(tmp_path, 8)  # killed mid-save: shards half written, no manifest, never renamed
    (tmp / WORKERS / "model_world_size_2_rank_0.pt").write_bytes(b"\x00" * 10)
    assert [p.name for p in saved_steps(tmp_path)] == ["step_00000004"]
    assert latest(tmp_path).step == 4
    save(tmp_path, 8)  # the next save clears the leftover
    assert not list(tmp_path.glob(".*partial")) and latest(tmp_path).step == 8


def test_a_failing_rename_leaves_the_previous_checkpoint_the_latest(tmp_path, monkeypatch):
    save(tmp_path, 4)
    tmp = begin_save(tmp_path, 8)
    FakeShardWriter().save_checkpoint(tmp / WORKERS, 8)

    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "rename", disk_full)
    with pytest.raises(OSError):
        commit_save(tmp, 8, {})
    monkeypatch.undo()
    assert latest(tmp_path).step == 4 and not step_dir(tmp_path, 8).exists()


def test_a_checkpoint_without_manifest_is_skipped_and_named(tmp_path):
    save(tmp_path, 4)
    newest = save(tmp_path, 8)
    (newest / MANIFEST).unlink()  # e.g. copied by hand, or a crash on a filesystem without atomic rename
    point = latest(tmp_path)
    assert point.step == 4 and point.skipped == [f"{newest}: incomplete, no {MANIFEST} (the save did not finish)"]


def test_a_truncated_shard_falls_back_to_the_previous_checkpoint_naming_the_file(tmp_path):
    save(tmp_path, 4)
    newest = save(tmp_path, 8)
    shard = newest / WORKERS / "model_world_size_2_rank_1.pt"
    shard.write_bytes(shard.read_bytes()[:50])
    point = latest(tmp_path)
    assert point.step == 4
    assert point.skipped == [f"{shard}: 50 bytes, the manifest says 101"]


def test_sha256_catches_a_same_size_corruption(tmp_path):
    plain, hashed = save(tmp_path / "plain", 4), save(tmp_path / "hashed", 4, hashes=True)
    for path in (plain, hashed):
        shard = path / WORKERS / "model_world_size_2_rank_0.pt"
        shard.write_bytes(b"\xff" * len(shard.read_bytes()))
    assert problem(plain) is None  # sizes only: this is verl's load to find out
    assert problem(hashed) == f"{hashed / WORKERS / 'model_world_size_2_rank_0.pt'}: sha256 differs from the manifest"


def test_no_usable_checkpoint_is_an_error_not_a_silent_restart(tmp_path):
    newest = save(tmp_path, 4)
    (newest / "loop.json").unlink()
    with pytest.raises(CheckpointError, match=f"^no usable checkpoint in {tmp_path}: {newest}/loop.json: missing$"):
        latest(tmp_path)


def test_rotation_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (2, 4, 6):
        save(tmp_path, step)
    begin_save(tmp_path, 8)  # an unfinished save does not count
    assert [p.name for p in rotate(tmp_path, 2)] == ["step_00000002"]
    assert [p.name for p in saved_steps(tmp_path)] == ["step_00000006", "step_00000004"]
    assert rotate(tmp_path, 0) == []


def test_checkpointer_saves_when_due_and_rotates(tmp_path):
    cfg = CheckpointConfig(every_steps=3, at_end=True, keep_last=2, sha256=False)
    checkpointer = Checkpointer(tmp_path, cfg, total_steps=10, workers=FakeShardWriter(), run_state={"seed": 7})
    due = [steps for steps in range(1, 11) if checkpointer.due(steps)]
    assert due == [3, 6, 9, 10]
    for steps in due:
        checkpointer.save(steps, {"nonfinite_steps": 1})
    assert [p.name for p in saved_steps(tmp_path)] == ["step_00000010", "step_00000009"]
    assert latest(tmp_path).state == {"step": 10, "seed": 7, "nonfinite_steps": 1}


def test_resume_modes(tmp_path):
    assert resume_point(tmp_path, "auto") is None and resume_point(tmp_path, "never") is None
    with pytest.raises(ConfigError, match="resume=must, but there is no checkpoint"):
        resume_point(tmp_path, "must")
    save(tmp_path, 4)
    assert resume_point(tmp_path, "auto").step == 4 == resume_point(tmp_path, "must").step
    with pytest.raises(ConfigError, match="resume=never, but .* holds checkpoints"):
        resume_point(tmp_path, "never")


def test_metrics_keep_only_the_steps_before_the_resume_point(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"train/step": s, "train/loss": 1.0 / (s + 1)} for s in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"train/step": 6, "train/lo')  # cut by a kill
    keep_rows_before(path, 4)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:4]


def test_a_checkpoint_resumes_only_on_the_device_kind_that_saved_it(tmp_path):
    """verl loads its shards without map_location: cuda tensors do not load on a CPU machine (nor CPU ones where
    the model lives on GPUs). The device is in loop.json; a checkpoint from before it was recorded is let through."""
    check_checkpoint_device(ResumePoint(tmp_path, {"step": 4, "device": "cpu"}), "cpu")
    check_checkpoint_device(ResumePoint(tmp_path, {"step": 4}), "cuda")
    with pytest.raises(ConfigError) as info:
        check_checkpoint_device(ResumePoint(tmp_path / "step_00000004", {"step": 4, "device": "cuda"}), "cpu")
    assert str(info.value) == (
        f"backend.device: this run trains on cpu, but {tmp_path / 'step_00000004'} was saved by cuda workers and verl "
        "loads it onto cuda only: set backend.device=cuda to continue it, or use another run dir"
    )
