"""Checkpoints on disk: atomic, verified, rotated. Pure Python (stdlib only); the workers write the shards.

    <run dir>/checkpoints/step_00000010/    10 steps done: a resumed run continues at step 10
        workers/       verl's files, one set per rank (model, optimizer, extra state: lr scheduler + RNG)
        loop.json      the loop's own state: next step, seed, device (cpu, cuda), non-finite count
        MANIFEST.json  written last: every file with its size (and sha256 when asked)

A save is written into `.step_00000010.partial/` and renamed into place after its manifest: a crash while
saving leaves a `.partial` folder, which is never loaded and is removed by the next save. verl writes its
files in place and keeps no completeness marker (../shared/design/verl-checkpoints.md), hence all this.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from tinker_exp.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from tinker_exp.config import CheckpointConfig
    from tinker_exp.train.protocols import Workers

MANIFEST = "MANIFEST.json"
LOOP_STATE = "loop.json"
WORKERS = "workers"
PREFIX = "step_"
PARTIAL = ".partial"


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f".{PREFIX}{step:08d}{PARTIAL}"


def begin_save(root: Path, step: int) -> Path:
    """A fresh folder to write step's checkpoint into (what a crashed save left there is removed)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".{PREFIX}*{PARTIAL}"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = partial_dir(root, step)
    (tmp / WORKERS).mkdir(parents=True)
    return tmp


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> Iterator[Path]:
    return (p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_save(tmp: Path, step: int, loop_state: dict[str, Any], hashes: bool = False, final: Path | None = None) -> Path:
    """Write loop.json and the manifest (last), flush everything to disk, then rename into place.

    `final`: a folder of another name than the step's, e.g. a served checkpoint's."""
    (tmp / LOOP_STATE).write_text(json.dumps({"step": step, **loop_state}, indent=1) + "\n")
    manifest = {}
    for path in _files(tmp):
        _fsync(path)
        entry: dict[str, Any] = {"bytes": path.stat().st_size}
        if hashes:
            entry["sha256"] = _sha256(path)
        manifest[str(path.relative_to(tmp))] = entry
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": manifest}, indent=1) + "\n")
    _fsync(tmp / MANIFEST)
    final = final or step_dir(tmp.parent, step)
    if final.exists():  # the same step saved again (a resumed run that saves where it resumed)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(tmp.parent)
    return final


def problem(checkpoint: Path) -> str | None:
    """Why this checkpoint cannot be loaded (naming the file), or None when it is complete and intact."""
    manifest_path = checkpoint / MANIFEST
    if not manifest_path.is_file():
        return f"{checkpoint}: incomplete, no {MANIFEST} (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as e:
        return f"{manifest_path}: unreadable ({e})"
    for name, entry in files.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{path}: missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{path}: {size} bytes, the manifest says {entry['bytes']}"
        if "sha256" in entry and _sha256(path) != entry["sha256"]:
            return f"{path}: sha256 differs from the manifest"
    if LOOP_STATE not in files:
        return f"{checkpoint}: no {LOOP_STATE}"
    return None


def saved_steps(root: Path) -> list[Path]:
    """Checkpoint folders (complete or not), newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]), reverse=True)


@dataclass
class ResumePoint:
    path: Path
    state: dict[str, Any]
    skipped: list[str] = field(default_factory=list)  # newer checkpoints that could not be used, and why

    @property
    def step(self) -> int:
        return int(self.state["step"])


def latest(root: Path) -> ResumePoint | None:
    """The newest complete, intact checkpoint; newer broken ones are listed in `skipped`.

    Raises CheckpointError when checkpoints exist but none is usable: starting over silently would
    overwrite a run's history.
    """
    skipped = []
    for path in saved_steps(root):
        why = problem(path)
        if why is None:
            return ResumePoint(path, saved_loop_state(path), skipped)
        skipped.append(why)
    if skipped:
        raise CheckpointError(f"no usable checkpoint in {root}: " + "; ".join(skipped))  # one line, every reason
    return None


def saved_loop_state(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's loop.json: the loop's state when it was saved."""
    return json.loads((checkpoint / LOOP_STATE).read_text())


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name[len(PREFIX) :])


def rotate(root: Path, keep_last: int, keep_every: int = 0, keep: tuple[int, ...] = ()) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (0: keep all); returns what was deleted.

    Spared: every step that is a multiple of `keep_every` (branch points) and the steps in `keep` (the best, a grid's shared prefixes)."""
    if keep_last <= 0:
        return []
    complete = [p for p in saved_steps(root) if (p / MANIFEST).is_file()]
    kept = lambda p: (keep_every and step_of(p) % keep_every == 0) or step_of(p) in keep  # noqa: E731
    doomed = [p for p in complete[keep_last:] if not kept(p)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


BEST = "BEST.json"
"""In the checkpoint root, with checkpoint.keep_best: the kept best checkpoint's step, metric and value."""


def best_checkpoint(root: Path) -> dict[str, Any] | None:
    """What BEST.json says (step, metric, value, path), if the checkpoint it names still exists."""
    try:
        best = json.loads((root / BEST).read_text())
    except (OSError, ValueError):
        return None
    path = step_dir(root, best["step"])
    return {**best, "path": str(path)} if path.is_dir() else None


def check_checkpoint_device(point: ResumePoint, device: str) -> None:
    """Refuse a checkpoint saved from another device kind, before any worker starts.

    verl loads its shards without map_location (cuda tensors on a CPU machine fail; CPU ones on GPUs would land beside
    the model). Checkpoints from before the device was recorded are let through."""
    saved = point.state.get("device")
    if saved is not None and saved != device:
        raise ConfigError(
            f"backend.device: this run trains on {device}, but {point.path} was saved by {saved} workers and verl "
            f"loads it onto {saved} only: set backend.device={saved} to continue it, or use another run dir"
        )


def resume_point(root: Path, mode: str) -> ResumePoint | None:
    """Where a run continues, by `resume` mode (auto, must, never); checked before any worker starts."""
    if mode == "never":
        if saved_steps(root):
            raise ConfigError(f"resume=never, but {root} holds checkpoints: use resume=auto or another run dir")
        return None
    point = latest(root)
    if point is None and mode == "must":
        raise ConfigError(f"resume=must, but there is no checkpoint in {root}")
    return point


class Checkpointer:
    """Saves through the workers into the checkpoint root when a save is due, atomically, then rotates.

    `metric`: the objective metric; with checkpoint.keep_best a checkpoint saved at an evaluation step with its best
    value so far (lowest; highest with `sign` -1) is kept outside the rotation (BEST.json names it; a resumed run reads it back).
    `keep_at`: steps also saved and kept outside the rotation (where later points of a grid continue: a shared prefix)."""

    def __init__(
        self, root: Path, cfg: CheckpointConfig, total_steps: int, workers: Workers, run_state: dict[str, Any],
        metric: str | None = None, sign: int = 1, keep_at: tuple[int, ...] = (),
    ):  # fmt: skip
        self.root, self.cfg, self.total_steps, self.workers = root, cfg, total_steps, workers
        self.keep_at = tuple(keep_at)
        self.run_state = run_state  # what every checkpoint of this run records (seed, device)
        self.metric, self.sign = metric, sign  # sign -1: higher is better (objective_mode=max)
        self.best = best_checkpoint(root) if cfg.keep_best else None

    def due(self, steps_done: int) -> bool:
        every = self.cfg.every_steps
        return bool(every and steps_done % every == 0) or (self.cfg.at_end and steps_done == self.total_steps) or steps_done in self.keep_at

    def save(self, steps_done: int, loop_state: dict[str, Any], row: dict[str, Any] | None = None) -> Path:
        """`row`: the step's metrics row (its objective value decides the best checkpoint)."""
        tmp = begin_save(self.root, steps_done)
        self.workers.save_checkpoint(tmp / WORKERS, steps_done)
        final = commit_save(tmp, steps_done, {**self.run_state, **loop_state}, hashes=self.cfg.sha256)
        value = (row or {}).get(self.metric) if self.cfg.keep_best and self.metric else None
        if value is not None and (self.best is None or self.sign * value < self.sign * self.best["value"]):
            self.best = {"step": steps_done, "metric": self.metric, "value": value, "path": str(final)}
            (self.root / BEST).write_text(json.dumps(self.best) + "\n")
        rotate(self.root, self.cfg.keep_last, self.cfg.keep_every, ((self.best["step"],) if self.best else ()) + self.keep_at)
        return final


def restore(workers: Workers, checkpoint: Path) -> None:
    """Load a checkpoint's worker state (model, optimizer, lr scheduler, RNG on every rank)."""
    try:
        workers.load_checkpoint(checkpoint / WORKERS)
    except Exception as e:  # a file that passed the size check but does not load
        raise CheckpointError(f"{checkpoint}: verl could not load it: {type(e).__name__}: {e}") from e
