"""Shared plan prefixes in a grid: which point continues from which earlier point's checkpoint, and at which step.

Pure Python (numpy for the plans' columns, imported when compared): decided before launch from the points' checked configs and their plans.

Two points share the steps before n when nothing that shapes those steps differs:
- their configs are equal but for SHAREABLE keys (their per-step plans and their lengths), and neither is a dry run,
  a branch, an RL run or a run that may stop early (kept out: each would need its own argument of equality);
- their plans send the same keys, are built with the same optimizer values, and send exactly equal values (float64,
  compared as stored, never with a tolerance) at every step below n;
- n is below both runs' lengths: the last step's evaluation (and checkpoint) of a run are its own.

The longest common prefix (lcp) of plans is an ultrametric, so "each point continues from the earlier point it shares
the longest prefix with" trains the fewest steps whatever the points' order; the earlier point comes first in the
grid, so it is started first. A share shorter than MIN_SHARED_STEPS is not taken.

On disk (written by the sweep, read by each job): PREFIXES in the sweep dir, `{"jobs": {num: {"from_job", "from",
"step"}}, "keep": {num: [steps]}}`, and ENDED/<num> once the sweep has seen job num end.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from tinker_exp.train.start import SharedPrefix, flat

SHAREABLE = ("override.", "trainer.steps")
"""Config keys (a trailing dot: a whole group) two points may differ in and still share a prefix: what a branch may
change without touching the state at its step. Everything else (model, data, seed, optimizer, batch, evaluation,
checkpoints, logging) must be equal."""

MIN_SHARED_STEPS = 4
"""The shortest prefix worth a branch start: the source saves one more checkpoint and the point loads it (on this
repo's CPU machine a save and a load of the tiny model cost about what 3-4 of its steps do; on GPUs a model's
checkpoint is a larger share of a step's cost, never less)."""

PREFIXES = "prefixes.json"
"""In the sweep dir: each sharing point's source job, its run dir and the step, and the steps each source keeps."""
ENDED = ".prefixes"
"""In the sweep dir: a file per source job the sweep has seen end (a point waiting for its checkpoint stops there)."""


@dataclass(frozen=True)
class Share:
    """A point's shared prefix: steps 0..step-1 are those point `source` (its index in the grid) trains."""

    source: int
    step: int


def why_not_shareable(cfg: Any) -> str | None:
    """Why a point never shares a prefix (None: it may)."""
    if cfg.dry_run:
        return "a dry run"
    if cfg.branch.source is not None:
        return "a branch"
    if cfg.env.active:
        return "an RL run"
    if cfg.trainer.early_stop.patience:
        return "early stopping"
    return None


def _shareable(key: str) -> bool:
    return any(key.startswith(p) if p.endswith(".") else key == p for p in SHAREABLE)


def fixed_part(cfg: Any) -> dict[str, Any]:
    """A point's config without its SHAREABLE keys: two points may share a prefix only where these are equal."""
    return {key: value for key, value in flat(asdict(cfg)).items() if not _shareable(key)}


def common_prefix(a: Any, b: Any) -> int:
    """The steps two plans send exactly the same values at, from step 0 (0 where they send different keys)."""
    import numpy as np  # here: the sweeper's module (imported for --help too) stays at Hydra's import cost

    if a.optimizer != b.optimizer or a.optimizer_values != b.optimizer_values or set(a.columns) != set(b.columns):
        return 0
    n = min(len(a), len(b))
    for name in a.columns:
        differ = np.flatnonzero(a.column(name)[:n] != b.column(name)[:n])
        if differ.size:
            n = int(differ[0])
    return n


def plan_shares(configs: Sequence[Any], plans: Sequence[Any], min_steps: int = MIN_SHARED_STEPS) -> list[Share | None]:
    """For each point, in grid order: the earlier point it continues from and the step (None: it trains alone).

    `configs`: the points' checked configs; `plans`: their plans (tinker_exp.optim.Plan: `len`, `columns`,
    `column(name)`, `optimizer`, `optimizer_values`). Of the earlier points with the longest shared prefix the first
    is taken; a source that itself continues from another at a step >= n has no checkpoint of its own at n, so its
    own source is taken instead (the ultrametric: that one shares at least n steps too)."""
    fixed = [None if why_not_shareable(cfg) else fixed_part(cfg) for cfg in configs]
    shares: list[Share | None] = []
    for i, plan in enumerate(plans):
        best: Share | None = None
        for j in range(i) if fixed[i] is not None else ():
            if fixed[j] != fixed[i]:
                continue
            n = min(common_prefix(plans[j], plan), len(plan) - 1, len(plans[j]) - 1)
            if n >= min_steps and (best is None or n > best.step):
                best = Share(j, n)
        while best is not None and (above := shares[best.source]) is not None and above.step >= best.step:
            best = Share(above.source, min(best.step, above.step))
        shares.append(best)
    return shares


def keep_steps(shares: Sequence[Share | None]) -> dict[int, list[int]]:
    """Each source point's steps to save and keep a checkpoint at (where a later point continues)."""
    keep: dict[int, set[int]] = {}
    for share in shares:
        if share is not None:
            keep.setdefault(share.source, set()).add(share.step)
    return {num: sorted(steps) for num, steps in sorted(keep.items())}


def shares_line(shares: Sequence[Share | None], plans: Sequence[Any]) -> str:
    """The sweep's line: how many points continue from another's checkpoint, and the steps trained of the grid's."""
    taken = [share for share in shares if share is not None]
    total = sum(len(plan) for plan in plans)
    trained = total - sum(share.step for share in taken)
    return (f"shared prefixes: {len(taken)} of {len(shares)} points branch from another's checkpoint; {trained} steps "
            f"trained of the grid's {total} (hydra.sweeper.share_prefixes=false: each trains alone)")  # fmt: skip


def clear(sweep_dir: Path) -> None:
    """What an earlier start of this sweep decided (a rerun decides again)."""
    (sweep_dir / PREFIXES).unlink(missing_ok=True)
    shutil.rmtree(sweep_dir / ENDED, ignore_errors=True)


def write(sweep_dir: Path, shares: Sequence[Share | None], run_dirs: Sequence[Path]) -> None:
    """PREFIXES for the jobs to read: each point's share and run dir, by job number (its index in the grid)."""
    jobs = {
        str(i): {"from_job": share.source, "from": str(run_dirs[share.source].absolute()), "step": share.step}
        for i, share in enumerate(shares) if share is not None
    }  # fmt: skip
    keep = {str(num): steps for num, steps in keep_steps(shares).items()}
    (sweep_dir / PREFIXES).write_text(json.dumps({"jobs": jobs, "keep": keep}, indent=1) + "\n", encoding="utf-8")


def mark_ended(sweep_dir: Path, num: int) -> None:
    """Say that job `num` has ended (a point waiting for its checkpoint then stops waiting)."""
    if (sweep_dir / PREFIXES).is_file():
        (sweep_dir / ENDED).mkdir(exist_ok=True)
        (sweep_dir / ENDED / str(num)).touch()


def role_of(sweep_dir: Path | str, num: int | None) -> tuple[SharedPrefix | None, tuple[int, ...]]:
    """Job `num`'s part in its grid's shared prefixes (PREFIXES), read by the job.

    Where its first steps come from (None: it trains from step 0), and the steps it keeps a checkpoint at for later
    points."""
    path = Path(sweep_dir) / PREFIXES
    if num is None or not path.is_file():
        return None, ()
    doc: Mapping[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    keep = tuple(doc.get("keep", {}).get(str(num), ()))
    source = doc.get("jobs", {}).get(str(num))
    if source is None:
        return None, keep
    ended = Path(sweep_dir) / ENDED / str(source["from_job"])
    return SharedPrefix(Path(source["from"]), int(source["from_job"]), int(source["step"]), ended), keep
