"""Where a run starts: step 0, its own run dir's checkpoint (resume) or another run's checkpoint (branch).

One answer for `main.py`: what is loaded, from which step the plan applies, which metrics rows are kept, and what
the terminal, plan.json, job.json and W&B are told. Everything here is decided before any worker starts. Pure Python.

- Resume: the run dir has a usable checkpoint. Its saved config.yaml must train the same thing: only RESUME_FREE keys
  may differ (a different plan, model, data, ... is a new run: `branch.from=`). A run whose checkpoint is at its last
  step is complete: nothing is started.
- Branch: `branch.from=<trunk run dir>` and no checkpoint of its own yet. The trunk's checkpoint at `branch.step` is
  loaded (model, optimizer, RNG, the loop's state), and from that step on this config's plan, steps, evaluation and
  data apply. The batch of step s is a function of (data file, trainer.seed, s) (train/data.py), so with the trunk's
  data and seed the branch sees the batches the trunk would have seen. Only BRANCH_FIXED keys must equal the trunk's:
  the checkpoint would not load, or would mean something else, otherwise. The trunk's run dir is only read.
- Shared prefix (a grid point whose plan equals an earlier point's up to step n: tinker_exp/sweep/prefixes.py): no
  checkpoint of its own yet; it waits for that point's checkpoint at n and continues from it, its rows before n copied
  from that point's metrics.jsonl (marked SHARED_FROM), as if it had trained them itself. A source that ends without
  that checkpoint: it trains from step 0.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from tinker_exp.config import Config
from tinker_exp.errors import CheckpointError, ConfigError
from tinker_exp.formats import read_jsonl
from tinker_exp.train.checkpoints import ResumePoint, check_checkpoint_device, latest, problem, resume_point, saved_loop_state, saved_steps, step_dir

log = logging.getLogger(__name__)

SAVED_CONFIG = "config.yaml"
"""In the run dir: the resolved config of its last start (what a resume is compared with, a branch checked against)."""
WANDB_RUN_ID = "wandb_run_id"
SHARED_FROM = "shared_from"
"""In a metrics row a grid point copied from another point's run (a shared prefix): that point's job number."""
WAIT_POLL_S = 0.5
"""How often a point waiting for its source's checkpoint looks for it (a file's appearance, in another process)."""

RESUME_FREE = (
    "logger.", "verbose", "dry_run", "resume", "plan_steps", "checkpoint.", "trainer.eval_every", "trainer.objective",
    "trainer.objective_mode", "trainer.max_nonfinite_steps", "backend.ray_address", "backend.pool", "backend.nodes_timeout_s",
    "model.cache_dir",
)  # fmt: skip
"""Keys (a trailing dot: a whole group) a resume may change: they change nothing that was or will be trained."""

BRANCH_FIXED = (
    "model.", "lora.", "optimizer.", "backend.strategy", "backend.num_workers", "backend.nodes", "backend.precision",
)  # fmt: skip
"""Keys a branch must share with its trunk: the checkpoint would not load (world size, model, adapters) or would mean
something else (the optimizer's class and values). `model.cache_dir` is where, not what; the device kind is checked
against the checkpoint itself (loop.json)."""


@dataclass
class StartPoint:
    kind: str = "start"
    """start (step 0), resume (the run dir's own checkpoint) or branch (another run's checkpoint)."""
    checkpoint: ResumePoint | None = None
    """What the workers load; None: step 0."""
    lineage: dict[str, Any] | None = None
    """A branch's origin, also when the branch itself is resumed: the trunk's run dir (`from`), `step`, the
    `checkpoint` loaded and the trunk's W&B run id. Into plan.json, job.json and the W&B config."""
    complete: bool = False
    """A resume at the run's last step (or after an early stop): there is nothing to train."""
    shared: dict[str, Any] | None = None
    """A shared prefix's origin (kind "shared"): the source's run dir (`from`), its job number (`job`), `step` and
    the `checkpoint` loaded. Into job.json and the W&B config."""
    shared_rows: list[dict[str, Any]] = field(default_factory=list)
    """A shared prefix's rows (steps before `step`, from the source's metrics.jsonl, each marked SHARED_FROM): logged
    to every sink before the run's own steps."""
    keep_at: tuple[int, ...] = ()
    """Steps this run also saves and keeps a checkpoint at: where later points of its grid continue from."""

    @property
    def step(self) -> int:
        """The first step this run trains (and logs: metrics.jsonl keeps the rows before it)."""
        return self.checkpoint.step if self.checkpoint else 0

    @property
    def loop_state(self) -> dict[str, Any]:
        return dict(self.checkpoint.state) if self.checkpoint else {}

    @property
    def first_logged(self) -> int:
        """The first step whose row this run logs (a shared prefix logs its copied rows too: from step 0)."""
        return 0 if self.kind == "shared" else self.step

    @property
    def trunk_wandb_run_id(self) -> str | None:
        return (self.lineage or {}).get("trunk_wandb_run_id")

    def describe(self) -> str:
        """The terminal's line about where the run starts."""
        if self.kind == "branch":
            assert self.checkpoint is not None and self.lineage is not None
            wandb = f", trunk W&B run {self.trunk_wandb_run_id}" if self.trunk_wandb_run_id else ""
            return f"branch of {self.lineage['from']} at step {self.step} (its checkpoint {self.checkpoint.path}{wandb}); this run's own plan from step {self.step}"
        if self.kind == "shared":
            assert self.checkpoint is not None and self.shared is not None
            return (f"shared prefix: steps 0..{self.step - 1} as job {self.shared['job']} trained them (its checkpoint "
                    f"{self.checkpoint.path}); this run trains from step {self.step}")  # fmt: skip
        if self.kind == "resume":
            assert self.checkpoint is not None
            origin = f" (a branch of {self.lineage['from']} at step {self.lineage['step']})" if self.lineage else ""
            return f"resuming from {self.checkpoint.path} at step {self.step}{origin}"
        return "starting at step 0"


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as {dotted key: leaf value} (lists are leaves)."""
    if isinstance(tree, Mapping) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: None if isinstance(tree, Mapping) else tree}


def differing(saved: Mapping[str, Any], now: Mapping[str, Any], compared: Any) -> list[str]:
    """`key: saved -> now` for each key, selected by `compared(key)`, whose values differ.

    A key only one side has counts (as None) under `override`, where keys come and go with the plan; elsewhere it is a
    key the schema gained since the saved config was written, which then held its default."""
    old, new = flat(saved), flat(now)
    both = lambda key: (key in old and key in new) or key.split(".")[0] == "override"  # noqa: E731
    keys = sorted(key for key in old.keys() | new.keys() if both(key) and compared(key))
    return [f"{key}: {_shown(old.get(key))} -> {_shown(new.get(key))}" for key in keys if old.get(key) != new.get(key)]


def _shown(value: Any) -> str:
    """A config value as a user types it (YAML's words): cosine, SGD (not an enum's repr), null, true, [0.9, 0.95]."""
    from enum import Enum

    if isinstance(value, Enum):
        value = value.value
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(map(_shown, value))}]"
    return str(value)


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key.startswith(p) if p.endswith(".") else key == p or key.startswith(p + ".") for p in patterns)


def read_saved_config(run_dir: Path) -> dict[str, Any] | None:
    from omegaconf import OmegaConf

    path = run_dir / SAVED_CONFIG
    return OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else None  # type: ignore[return-value]


@dataclass(frozen=True)
class SharedPrefix:
    """A grid point's part in a shared prefix: its steps before `step` are those job `job` trains in `source`."""

    source: Path
    """The source job's run dir."""
    job: int
    step: int
    ended: Path
    """A file the sweep writes once the source job has ended (with or without the checkpoint)."""
    stopped: Callable[[], bool] | None = None
    """Whether this job was cancelled while it waits (a job on a thread of the sweep's process)."""


def start_point(
    cfg: Config, resolved: Mapping[str, Any], run_dir: Path, shared: SharedPrefix | None = None, keep_at: tuple[int, ...] = ()
) -> StartPoint:
    """Where this run starts; `resolved`: its config as config.yaml will hold it.

    `shared`: a grid point's shared prefix (waited for here when the run has no checkpoint of its own); `keep_at`: steps
    it keeps a checkpoint at for later points of its grid. Raises ConfigError (one line, naming the keys) when the run
    dir or the trunk cannot start this config."""
    own = resume_point(run_dir / cfg.checkpoint.dir, cfg.resume.value)  # a killed branch resumes from its own
    if own is not None:
        start = resumed(cfg, resolved, run_dir, own)
    elif cfg.branch.source is not None:
        start = branched(cfg, resolved, run_dir)
    elif shared is not None:
        start = shared_start(cfg, shared)
    else:
        start = StartPoint()
    start.keep_at = tuple(keep_at)
    return start


def wait_for_source(shared: SharedPrefix, checkpoints: str) -> bool:
    """Wait until the source's checkpoint at `shared.step` is there and intact (True), or the source ended without it.

    `checkpoints`: checkpoint.dir (the source's config is this run's but for its plan). The wait is said once; it
    looks every WAIT_POLL_S and stops at a cancel (`shared.stopped`: KeyboardInterrupt)."""
    path = step_dir(shared.source / checkpoints, shared.step)
    said = False
    while problem(path) is not None:
        if shared.ended.exists():
            return problem(path) is None  # it may have saved it just before it ended
        if shared.stopped is not None and shared.stopped():
            raise KeyboardInterrupt
        if not said:
            log.info(f"shared prefix: waiting for job {shared.job}'s checkpoint at step {shared.step} ({path})")
            said = True
        time.sleep(WAIT_POLL_S)
    return True


def shared_start(cfg: Config, shared: SharedPrefix) -> StartPoint:
    """A grid point's start from its source's checkpoint at `shared.step`, once the source has saved it.

    Waits (before any worker or pool is taken) until the checkpoint is there and intact, or the source has ended
    without it: then this point trains from step 0, said in one line."""
    path = step_dir(shared.source / cfg.checkpoint.dir, shared.step)
    if not wait_for_source(shared, cfg.checkpoint.dir):
        log.info(f"shared prefix: job {shared.job} ended without its checkpoint at step {shared.step} ({path}); "
                 "this run trains from step 0")  # fmt: skip
        return StartPoint()
    point = ResumePoint(path, saved_loop_state(path))
    _check_device(cfg, point)
    rows = [row for row in read_jsonl(shared.source / "metrics.jsonl") if row.get("train/step", shared.step) < shared.step]
    if [row["train/step"] for row in rows] != list(range(shared.step)):
        log.info(f"shared prefix: {shared.source / 'metrics.jsonl'} does not hold each step before {shared.step} once; "
                 "this run trains from step 0")  # fmt: skip
        return StartPoint()
    lineage = {"from": str(shared.source), "job": shared.job, "step": shared.step, "checkpoint": str(path)}
    return StartPoint("shared", point, shared=lineage, shared_rows=[{**row, SHARED_FROM: shared.job} for row in rows])


def _send_instead(changed: list[str], override: Any) -> str:
    """How to change optimizer values an override can send (lr, betas, ...) in a branch, in its override's form.

    A key the branch's override schedules: the schedule's value; one it sets: itself; one it lacks: with +."""
    from tinker_exp.optim.convert import OVERRIDE_KEYS

    keys = [key for key in dict.fromkeys(line.split(":")[0].split(".")[1] for line in changed if line.startswith("optimizer."))
            if key in OVERRIDE_KEYS]  # fmt: skip
    if not keys:
        return ""
    sent = override if isinstance(override, Mapping) else {}
    forms = [
        f"override.{key}.value=..." if isinstance(sent.get(key), Mapping) and "value" in sent[key]
        else f"override.{key}=..." if sent.get(key) is not None else f"+override.{key}=..."
        for key in keys
    ]  # fmt: skip
    return (
        f"; to change {', '.join(f'optimizer.{key}' for key in keys)} from the branch step on, send it with every "
        f"step instead: {' '.join(forms)}"
    )


def _check_device(cfg: Config, point: ResumePoint) -> None:
    if cfg.backend.device.value != "auto":  # auto is resolved with torch: a real run checks it (train_run)
        check_checkpoint_device(point, cfg.backend.device.value)


def resumed(cfg: Config, resolved: Mapping[str, Any], run_dir: Path, point: ResumePoint) -> StartPoint:
    for why in point.skipped:
        warnings.warn(f"not resuming from a broken checkpoint: {why}; falling back to {point.path.name}", stacklevel=1)
    _check_device(cfg, point)
    saved = read_saved_config(run_dir)
    if saved is not None:
        changed = differing(saved, resolved, lambda key: not _matches(key, RESUME_FREE))
        if changed:
            raise ConfigError(
                f"{run_dir} holds a run of another config ({'; '.join(changed)}): a resume may change only "
                f"logging, checkpoint and evaluation settings; to train this config from its checkpoint, start a new "
                f"run dir with branch.from={run_dir}"
            )
    lineage = point.state.get("branch")  # a branch's checkpoints carry its origin (loop.json)
    return StartPoint("resume", point, lineage, complete=point.step >= cfg.trainer.steps or bool(point.state.get("early_stopped")))


def branched(cfg: Config, resolved: Mapping[str, Any], run_dir: Path) -> StartPoint:
    trunk = Path(cfg.branch.source).expanduser().resolve()
    if trunk == run_dir.resolve():
        raise ConfigError(f"branch.from={cfg.branch.source}: that is this run's own dir; a branch starts a new run dir")
    trunk_config = read_saved_config(trunk) if trunk.is_dir() else None
    if trunk_config is None:
        raise ConfigError(f"branch.from={cfg.branch.source}: not a tinker_exp run dir (no {SAVED_CONFIG} in {trunk})")
    point = checkpoint_at(checkpoints_of(trunk, trunk_config), cfg.branch.step, cfg.branch.source)
    if point.step >= cfg.trainer.steps:
        raise ConfigError(
            f"branch.step: {point.step} (the trunk's checkpoint) must be below trainer.steps={cfg.trainer.steps}: "
            "the branch would train nothing"
        )
    changed = differing(trunk_config, resolved, lambda key: _matches(key, BRANCH_FIXED) and key != "model.cache_dir")
    if changed:
        raise ConfigError(
            f"branch.from={cfg.branch.source}: {'; '.join(changed)} (the trunk's -> this run's); a branch must keep the "
            "trunk's model, LoRA, optimizer and workers for its checkpoint to load as saved" + _send_instead(changed, cfg.override)
        )
    _check_device(cfg, point)
    wandb_id = trunk / WANDB_RUN_ID
    lineage = {
        "from": str(trunk), "step": point.step, "checkpoint": str(point.path),
        "trunk_wandb_run_id": wandb_id.read_text().strip() if wandb_id.is_file() else None,
    }  # fmt: skip
    return StartPoint("branch", point, lineage)


def checkpoints_of(run_dir: Path, saved_config: Mapping[str, Any]) -> Path:
    """Where a run dir keeps its checkpoints (its saved config's checkpoint.dir)."""
    return run_dir / str(saved_config.get("checkpoint", {}).get("dir", "checkpoints"))


def branch_step(run_dir: Path) -> int | None:
    """The step a branch of `run_dir` starts at by default (its newest usable checkpoint), or None.

    None: it is no run dir, has no usable checkpoint, or has one only at its last step (a branch would train
    nothing)."""
    saved = read_saved_config(run_dir) if run_dir.is_dir() else None
    if saved is None:
        return None
    try:
        point = latest(checkpoints_of(run_dir, saved))
    except CheckpointError:
        return None
    if point is None or point.step >= int(saved.get("trainer", {}).get("steps", 0)):
        return None
    return point.step


def checkpoint_at(root: Path, step: int | None, source: str) -> ResumePoint:
    """The trunk's checkpoint at `step` (None: its newest usable one), complete and intact."""
    if step is None:
        point = latest(root)  # CheckpointError (exit 5) when it has checkpoints and none is usable
        if point is None:
            raise ConfigError(f"branch.from={source}: the run has no checkpoint to branch from (in {root})")
        return point
    path = step_dir(root, step)
    if not path.is_dir():
        have = sorted(int(p.name.split("_")[1]) for p in saved_steps(root) if problem(p) is None)
        raise ConfigError(f"branch.step: {source} has no checkpoint at step {step} (it has: {have or 'none'})")
    why = problem(path)
    if why is not None:
        raise ConfigError(f"branch.step={step}: the trunk's checkpoint is not usable: {why}")
    return ResumePoint(path, saved_loop_state(path))
