"""Population-based training, the member's side.

The board, the exploit decision, explore, the realized schedule and the lineage files. Pure Python (Optuna's
distributions for the space); `Member` is a judge of the loop (train/judges.py).

A member is an ordinary run whose job was told of its population (POPULATION_ENV, set by the pbt sweeper). Every
`interval` steps, at an evaluation, it saves a checkpoint, posts its score to the board and decides against the
members that have posted at that step (no barrier): one in the bottom quantile loads a top member's checkpoint into
its own running workers (exploit) and continues with that member's values, perturbed or resampled (explore), as a
new plan for the remaining steps. The plan is the only source of the values sent, so a loaded checkpoint never
brings old values back.

    <board>/<member>/<step>.json   a post: score, checkpoint, values (one file each, written atomically)
    <run dir>/population.jsonl     one row per boundary: score, rank, whose checkpoint was taken, the values after
    <run dir>/override/realized.yaml   the values sent at every step of the member's lineage, as an override file
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from tinker_exp.errors import ConfigError
from tinker_exp.formats import read_json, read_jsonl
from tinker_exp.train.judges import Decision, Judge, continue_from
from tinker_exp.train.objective import has_validation, objective_metric, objective_sign

if TYPE_CHECKING:
    from tinker_exp.train.protocols import TableSink
    from tinker_exp.train.start import StartPoint

POPULATION_ENV = "TINKER_EXP_POPULATION"
"""What a member's job is told of its population, as JSON (set by the pbt sweeper; tests set it themselves):
board, population, interval, quantile, perturb, resample_probability, seed, space {key: Optuna distribution JSON},
explore (perturb or pb2), force_exploit (test-only: {member, step, donor} or null)."""
EXPLORES = ("perturb", "pb2")
"""How an exploiting member explores: perturb (PBT: factors and resampling), pb2 (a GP bandit, tinker_exp/sweep/pb2.py)."""
POPULATION_FILE = "population.jsonl"
REALIZED = "realized"
"""The realized schedule's override name: <run dir>/override/realized.yaml, selected with +override=realized."""
METRICS = "metrics.jsonl"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Population:
    """The population a member belongs to, as POPULATION_ENV tells it."""

    board: Path
    """The folder of posts (<sweep dir>/population): one subfolder per member."""
    population: int
    """Members in all (P)."""
    interval: int
    """Steps between boundaries (K): a boundary after every K steps, before the last."""
    quantile: float = 0.25
    """The share of the ranked members that exploits (bottom) and is exploited (top)."""
    perturb: tuple[float, ...] = (0.8, 1.2)
    """Factors a value not resampled is multiplied by (one chosen at random)."""
    resample_probability: float = 0.25
    """Chance that a key is drawn afresh from the space instead of perturbed."""
    seed: int = 0
    """Seeds every choice (donor, explore), with the member and the step."""
    space: Mapping[str, Any] = field(default_factory=dict)
    """key (override.lr.value, ...) -> Optuna distribution."""
    force_exploit: Mapping[str, int] | None = None
    """Test-only: {member, step, donor}: that member exploits that donor at that step whatever the ranks."""
    explore: str = "perturb"
    """perturb (PBT's) or pb2 (the numeric keys proposed by a GP bandit over the members' improvements)."""

    def __post_init__(self) -> None:
        where = POPULATION_ENV
        if self.population < 2:
            raise ConfigError(f"{where}: population={self.population} must be >= 2")
        if self.interval < 1:
            raise ConfigError(f"{where}: interval={self.interval} must be >= 1")
        if not 0 < self.quantile <= 0.5:
            raise ConfigError(f"{where}: quantile={self.quantile} must be in (0, 0.5]")
        if not self.perturb or any(not factor > 0 for factor in self.perturb):
            raise ConfigError(f"{where}: perturb={list(self.perturb)} must be factors > 0")
        if not 0 <= self.resample_probability <= 1:
            raise ConfigError(f"{where}: resample_probability={self.resample_probability} must be in [0, 1]")
        if not self.space:
            raise ConfigError(f"{where}: space is empty: nothing to explore")
        if self.explore not in EXPLORES:
            raise ConfigError(f"{where}: explore={self.explore!r} must be one of {', '.join(EXPLORES)}")

    @classmethod
    def from_json(cls, text: str) -> "Population":
        from optuna.distributions import json_to_distribution

        try:
            told = json.loads(text)
            space = {key: json_to_distribution(value) for key, value in told.get("space", {}).items()}
            force = told.get("force_exploit")
            return cls(
                board=Path(told["board"]), population=int(told["population"]), interval=int(told["interval"]),
                quantile=float(told.get("quantile", 0.25)), perturb=tuple(float(f) for f in told.get("perturb", (0.8, 1.2))),
                resample_probability=float(told.get("resample_probability", 0.25)), seed=int(told.get("seed", 0)),
                space=space, force_exploit=None if force is None else {k: int(force[k]) for k in ("member", "step", "donor")},
                explore=str(told.get("explore", "perturb")),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{POPULATION_ENV}: not a population ({type(e).__name__}: {e})") from None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> "Population | None":
        return cls.from_json(environ[POPULATION_ENV]) if POPULATION_ENV in environ else None

    def is_boundary(self, steps_done: int, total_steps: int) -> bool:
        return steps_done % self.interval == 0 and 0 < steps_done < total_steps


# --- the board -------------------------------------------------------------------------------------------


def write_atomically(path: Path, text: str) -> None:
    """tmp + os.replace: a reader (on another node too) sees the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def post(board: Path, member: int, step: int, score: float, checkpoint: Path, values: Mapping[str, Any], sign: int = 1,
         start: Mapping[str, int] | None = None) -> Path:  # fmt: skip
    """Post the member's score at a boundary, with its checkpoint there and the values it trained the steps before with.

    `sign` -1: a higher score is better (trainer.objective_mode=max); `start`: the post {member, step} whose checkpoint
    those steps trained from (its own previous one, or a donor's), None for the first boundary: PB2's improvement over
    the interval is measured from its score."""
    path = board / str(member) / f"{step}.json"
    doc = {"member": member, "step": step, "score": score, "sign": sign, "checkpoint": str(Path(checkpoint).resolve()),
           "values": dict(values), "time": time.time(), "start": None if start is None else dict(start)}  # fmt: skip
    write_atomically(path, json.dumps(doc) + "\n")
    return path


def posts_at(board: Path, step: int) -> dict[int, dict[str, Any]]:
    """Every member's post at `step` (members that have not reached it yet: absent)."""
    posts = {}
    for path in sorted(board.glob(f"*/{step}.json")) if board.is_dir() else ():
        doc = read_json(path)
        if isinstance(doc, dict):
            posts[int(doc["member"])] = doc
    return posts


# --- the decision ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BoundaryDecision:
    """A member's decision at a boundary, from the posts there."""

    rank: int
    """1: the best of those that posted."""
    of: int
    """How many had posted at the step (this member included)."""
    donor: dict[str, Any] | None = None
    """The post whose checkpoint and values this member takes; None: it carries on."""


def quantile_size(n: int, quantile: float) -> int:
    """How many members exploit (and how many may be exploited) among n ranked ones: Ray Tune's rule."""
    return 0 if n < 2 else min(max(1, math.ceil(n * quantile)), n // 2)


def _sort_key(post: Mapping[str, Any]) -> tuple[float, int]:
    score = post["score"]
    finite = isinstance(score, (int, float)) and math.isfinite(score)
    return (post.get("sign", 1) * score if finite else math.inf, int(post["member"]))


def rng_for(population: Population, member: int, step: int, what: str) -> random.Random:
    """A generator seeded by (seed, member, step): a resumed member decides and explores as it would have."""
    return random.Random(f"{population.seed}:{member}:{step}:{what}")


def decide(population: Population, member: int, step: int, posts: Mapping[int, Mapping[str, Any]]) -> BoundaryDecision:
    """Rank the posts at `step`; a member in the bottom q takes a donor chosen (seeded) from the top q.

    Lower score is better, higher with objective_mode=max; non-finite ones last, ties by member number. force_exploit
    overrides it for one (member, step)."""
    ranked = sorted(posts.values(), key=_sort_key)
    order = [int(p["member"]) for p in ranked]
    if member not in order:
        raise ValueError(f"member {member} has not posted at step {step}")
    rank, n = order.index(member) + 1, len(order)
    force = population.force_exploit
    if force is not None and (force["member"], force["step"]) == (member, step):
        if force["donor"] not in posts:
            raise ConfigError(f"{POPULATION_ENV}: force_exploit: member {force['donor']} has not posted at step {step}")
        return BoundaryDecision(rank, n, dict(posts[force["donor"]]))
    q = quantile_size(n, population.quantile)
    if rank <= n - q:
        return BoundaryDecision(rank, n)
    donor = rng_for(population, member, step, "donor").choice(order[:q])
    return BoundaryDecision(rank, n, dict(posts[donor]))


FORCED_WAIT_S = 300.0
"""How long a member forced to exploit (test-only) waits for its donor's post at that step: members on other jobs or
workers reach a boundary in no set order."""


def wait_for_forced_donor(population: Population, member: int, step: int, wait_s: float = FORCED_WAIT_S) -> None:
    """Wait (bounded, polling the board) until a forced exploit's donor has posted at this member's step.

    Only when force_exploit (test-only) names this member and step, so a forced exploit does not depend on which member
    got there first; `decide` says it if never."""
    force = population.force_exploit
    if force is None or (force["member"], force["step"]) != (member, step):
        return
    deadline = time.monotonic() + wait_s
    while not (population.board / str(force["donor"]) / f"{step}.json").exists() and time.monotonic() < deadline:
        time.sleep(0.5)


# --- explore ---------------------------------------------------------------------------------------------


def valid_range(key: str, override: Mapping[str, Any], total_steps: int) -> tuple[Any, int | None]:
    """(the Range a value of `key` must lie in, the most steps it may count when it is a length in steps).

    override.K is key K's range; override.K.P a parameter of K's schedule: the key's range for its value parameters, the
    parameter's own for the others (a length within the schedule). None: no rule known here (the plan checks)."""
    from tinker_exp.optim.convert import RANGES, Range
    from tinker_exp.optim.schedules import PARAMS

    parts = key.split(".")
    if parts[0] != "override" or len(parts) < 2 or parts[1] not in RANGES:
        return None, None
    name, rest = parts[1], parts[2:]
    node: Any = override.get(name)
    if name == "betas" and rest and rest[0].isdigit():
        node = node[int(rest[0])] if isinstance(node, (list, tuple)) and int(rest[0]) < len(node) else None
        rest = rest[1:]
    if not rest:
        return RANGES[name], None
    if len(rest) != 1 or not isinstance(node, Mapping) or node.get("schedule") not in PARAMS:
        return None, None
    param = PARAMS[node["schedule"]].get(rest[0])
    if param is None:
        return None, None
    if param.peak or (param.kind == "number" and param.range == Range()):
        return RANGES[name], None
    return param.range, int(node.get("total_steps") or total_steps) if param.kind == "length" else None


def _clip(value: float, low: float | None, high: float | None, low_open: bool = False, high_open: bool = False) -> float:
    if low is not None and (value < low or (low_open and value <= low)):
        value = math.nextafter(low, math.inf) if low_open else low
    if high is not None and (value > high or (high_open and value >= high)):
        value = math.nextafter(high, -math.inf) if high_open else high
    return value


def _on_grid(value: float, low: float, high: float, step: float | int | None) -> float:
    return value if not step else low + round((value - low) / step) * step


def explored(
    values: Mapping[str, Any], population: Population, member: int, step: int, override: Mapping[str, Any], total_steps: int
) -> dict[str, Any]:
    """The donor's values explored: each key resampled or perturbed, then clipped. Seeded by (seed, member, step).

    Each key is resampled from the space with resample_probability, else multiplied by a factor from `perturb` (a
    categorical moves to a neighbouring choice); then clipped to the space's bounds (ints rounded, onto the step grid)
    and to the key's valid range."""
    from optuna.distributions import CategoricalDistribution

    rng = rng_for(population, member, step, "explore")
    out = dict(values)
    for key, dist in population.space.items():
        resample = rng.random() < population.resample_probability
        factor = rng.choice(population.perturb)
        direction = rng.choice((-1, 1))
        if isinstance(dist, CategoricalDistribution):
            choices = list(dist.choices)
            if resample or values.get(key) not in choices or len(choices) == 1:
                out[key] = rng.choice(choices)
            else:  # a neighbour; at either end the only one
                here = choices.index(values[key])
                out[key] = choices[here + direction if 0 <= here + direction < len(choices) else here - direction]
            continue
        low, high = dist.low, dist.high
        if resample:
            new = math.exp(rng.uniform(math.log(low), math.log(high))) if dist.log else rng.uniform(low, high)
        else:
            new = float(values[key]) * factor
        out[key] = into_space(key, dist, new, override, total_steps)
    return out


def into_space(key: str, dist: Any, new: float, override: Mapping[str, Any], total_steps: int) -> float | int:
    """A proposed value of a numeric key clipped to the space's bounds and to the key's valid range.

    Ints rounded, onto the step grid; a length at most the schedule's."""
    from optuna.distributions import IntDistribution

    low, high = dist.low, dist.high
    new = _clip(_on_grid(new, low, high, dist.step), low, high)
    rule, most = valid_range(key, override, total_steps)
    if rule is not None:
        new = _clip(new, rule.low, rule.high, rule.low_open, rule.high_open)
    if isinstance(dist, IntDistribution):
        new = min(max(int(round(new)), dist.low), dist.high)
        return min(new, most) if most is not None else new
    new = float(new)
    return min(max(new, 0.0), 1.0) if most is not None else new  # a float length is a fraction of the schedule


def numeric_keys(space: Mapping[str, Any]) -> list[str]:
    """The keys PB2's GP models (float and int dimensions; a choice is explored as PBT does)."""
    from optuna.distributions import CategoricalDistribution

    return [key for key, dist in space.items() if not isinstance(dist, CategoricalDistribution)]


def to_unit(dist: Any, value: float) -> float:
    """A numeric key's value on [0, 1] within the space's bounds (a log key in log space)."""
    if dist.log:
        return (math.log(value) - math.log(dist.low)) / (math.log(dist.high) - math.log(dist.low))
    return (value - dist.low) / (dist.high - dist.low)


def from_unit(dist: Any, unit: float) -> float:
    if dist.log:
        return math.exp(math.log(dist.low) + unit * (math.log(dist.high) - math.log(dist.low)))
    return dist.low + unit * (dist.high - dist.low)


def improvements(board: Path, step: int, population: Population) -> list[tuple[list[float], float, float]]:
    """PB2's data, from the board's posts up to `step`.

    For every post whose start is known and both scores finite: (the numeric values a member trained an interval with on
    [0, 1], the interval's end as a boundary index, its improvement: start score - score, sign applied)."""
    keys = numeric_keys(population.space)
    posts = [read_json(path) for path in sorted(board.glob("*/*.json"))] if board.is_dir() else []
    by_key = {(int(p["member"]), int(p["step"])): p for p in posts if isinstance(p, dict)}
    data = []
    for (member, at), doc in sorted(by_key.items()):
        start = doc.get("start")
        begin = by_key.get((int(start["member"]), int(start["step"]))) if start else None
        if at > step or begin is None or not all(math.isfinite(float(d["score"])) for d in (doc, begin)):
            continue
        if any(key not in doc["values"] for key in keys):
            continue
        x = [to_unit(population.space[key], float(doc["values"][key])) for key in keys]
        data.append((x, at / population.interval, doc.get("sign", 1) * (float(begin["score"]) - float(doc["score"]))))
    return data


def pb2_explored(
    values: Mapping[str, Any], population: Population, member: int, step: int, override: Mapping[str, Any], total_steps: int
) -> tuple[dict[str, Any], str]:
    """The donor's values explored by PB2; returns the values and a note for the log.

    The numeric keys proposed by the GP bandit over the improvements posted so far (tinker_exp/sweep/pb2.py), at the
    next boundary's time, then fitted into the space as `explored` does; a choice explored as PBT does. With fewer than
    2 improvements known (the first boundary): PBT's explore. Seeded by (seed, member, step)."""
    import numpy as np

    from tinker_exp.sweep.pb2 import propose

    out = explored(values, population, member, step, override, total_steps)
    data = improvements(population.board, step, population)
    if len(data) < 2:
        return out, f"pb2: {len(data)} improvement(s) known, explored as perturb"
    keys = numeric_keys(population.space)
    x, t, y = (np.array(column, dtype=float) for column in zip(*data))
    rng = np.random.default_rng(rng_for(population, member, step, "pb2").getrandbits(63))
    point = propose(x, t, y, step / population.interval + 1, rng)
    for key, unit in zip(keys, point):
        dist = population.space[key]
        out[key] = into_space(key, dist, from_unit(dist, float(unit)), override, total_steps)
    return out, f"pb2: proposed from {len(data)} improvements"


# --- values in an override tree --------------------------------------------------------------------------


def get_path(tree: Any, key: str) -> Any:
    """The value at a dotted key (override.lr.value, override.betas.1) of a plain config tree; None if absent."""
    node = tree
    for part in key.split("."):
        if isinstance(node, Mapping):
            node = node.get(part)
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def with_values(override: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the override mapping (plain) with each `override.`-key of `values` set to its value."""
    tree = {"override": copy.deepcopy(dict(override))}
    for key, value in values.items():
        *parents, last = key.split(".")
        node: Any = tree
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return tree["override"]


# --- the realized schedule -------------------------------------------------------------------------------


def _column_override(column: Sequence[float]) -> Any:
    """One value's every step as an override: a constant, or keyframes at each step where it changes and around it.

    Exact: keyframes give y0 + (y1 - y0) * 0 / (x1 - x0) = y0 at a point's own step, and the points left out lie
    between two equal values, where the same formula adds (y1 - y0) * t = 0."""
    if all(value == column[0] for value in column):
        return column[0]
    last = len(column) - 1
    points = {
        step: value for step, value in enumerate(column)
        if step in (0, last) or value != column[step - 1] or value != column[step + 1]
    }  # fmt: skip
    return {"schedule": "keyframes", "points": points}


def realized_override(sent: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The override mapping whose plan sends exactly `sent` (one params dict per step, from step 0).

    Each key a constant or keyframes; betas as its two components."""
    if not sent:
        return {}
    out: dict[str, Any] = {}
    for key in sent[0]:
        if key == "betas":
            out[key] = [_column_override([step[key][i] for step in sent]) for i in range(2)]
        else:
            out[key] = _column_override([step[key] for step in sent])
    return out


def sent_values(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What was sent at each step (metrics rows' requested/*), as optimizer_step's params."""
    from tinker_exp.optim.convert import nested_values

    prefix = "requested/"
    return [nested_values({key[len(prefix) :]: value for key, value in row.items() if key.startswith(prefix)}) for row in rows]


def realized_yaml(override: Mapping[str, Any]) -> str:
    """The override file's text (the floats as repr writes them: every digit)."""
    from omegaconf import OmegaConf

    body = OmegaConf.to_yaml(OmegaConf.create(dict(override))) if override else "{}\n"
    return "# @package override\n# The values this member sent at every step of its lineage (tinker_exp.sweep.pbt).\n" + body


def write_realized(run_dir: Path) -> Path:
    """override/realized.yaml from the member's lineage rows, so far."""
    path = run_dir / "override" / f"{REALIZED}.yaml"
    write_atomically(path, realized_yaml(realized_override(sent_values(lineage_rows(run_dir)))))
    return path


# --- lineage ---------------------------------------------------------------------------------------------


def population_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / POPULATION_FILE
    return read_jsonl(path) if path.exists() else []


def run_dir_of(checkpoint: Path) -> Path:
    """The run dir a checkpoint belongs to: the nearest folder above it holding metrics.jsonl."""
    for parent in Path(checkpoint).parents:
        if (parent / METRICS).exists():
            return parent
    raise FileNotFoundError(f"{checkpoint}: no run dir (with {METRICS}) above it")


def lineage_rows(run_dir: Path, until: int | None = None) -> list[dict[str, Any]]:
    """The metrics rows of the member's lineage for steps < `until` (None: all it has).

    Its last donor's lineage before that exploit's step (recursively), then its own rows. An exploit at step s changes
    the steps >= s only: the checkpoint a member posted at s holds what it trained before it exploited there."""
    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / METRICS) if (run_dir / METRICS).exists() else []
    end = until if until is not None else (max((row["train/step"] for row in rows), default=-1) + 1)
    # Without `until`: an exploit at the last step trained counts (the member holds the donor's state now).
    exploits = [
        row for row in population_rows(run_dir)
        if row.get("exploit") and (row["step"] < end or (until is None and row["step"] == end))
    ]  # fmt: skip
    begin, before = 0, []
    if exploits:
        exploit = exploits[-1]["exploit"]
        begin = exploits[-1]["step"]
        before = lineage_rows(run_dir_of(Path(exploit["checkpoint"])), begin)
    return before + [row for row in rows if begin <= row["train/step"] < end]


def realized_values(run_dir: Path) -> dict[str, list[float]]:
    """Every value the member's lineage sent, by its flat name (lr, beta1, weight_decay, ...), one entry per step."""
    prefix = "requested/"
    columns: dict[str, list[float]] = {}
    for row in lineage_rows(run_dir):
        for key, value in row.items():
            if key.startswith(prefix):
                columns.setdefault(key[len(prefix) :], []).append(value)
    return columns


# --- the member inside its job ---------------------------------------------------------------------------


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


class Member(Judge):
    """One member of a population inside its job, a judge of the loop.

    It wants a checkpoint at each boundary (an evaluation step), then posts it and decides (`saved`): carry on, or load
    a donor's checkpoint with a new plan. Before the first step a restarted member takes back its values and plan
    (`begin`); after the last it writes its realized schedule (`end`). Its values live here; each plan is built by the
    same converter and checks as any override."""

    def __init__(self, population: Population, number: int, run_dir: Path, override: Mapping[str, Any],
                 optimizer_cfg: Any, total_steps: int, metric: str, sign: int = 1):  # fmt: skip
        self.population, self.number, self.run_dir = population, number, Path(run_dir)
        self.override, self.optimizer_cfg, self.total_steps, self.metric = dict(override), optimizer_cfg, total_steps, metric
        self.sign = sign  # -1: a higher score is better (trainer.objective_mode=max)
        missing = [key for key in population.space if get_path({"override": self.override}, key) is None]
        if missing:
            raise ConfigError(f"{missing[0]}: a member's config must set every key of the space ({POPULATION_ENV})")
        self.values = {key: get_path({"override": self.override}, key) for key in population.space}
        self.plan = self.build(self.values)

    @classmethod
    def from_environment(cls, cfg: Any, run_dir: Path, number: int | None, metric: str,
                         environ: Mapping[str, str] = os.environ) -> "Member | None":  # fmt: skip
        """The member this job is (POPULATION_ENV set, a sweep job's number), else None: an ordinary run."""
        population = Population.from_environment(environ)
        if population is None or number is None:
            return None
        from tinker_exp.optim.convert import plain

        every, interval = cfg.trainer.eval_every, population.interval
        if not has_validation(cfg) or (every and interval % every) or cfg.trainer.steps < 2 * interval:
            raise ConfigError(
                f"trainer.eval_every={every}, trainer.steps={cfg.trainer.steps}: a member's boundaries (every {interval} "
                "steps, at least one before the last step) must be evaluation steps, with validation data"
            )

        return cls(population, number, run_dir, plain(cfg.override) or {}, cfg.optimizer, cfg.trainer.steps, metric, objective_sign(cfg))

    @classmethod
    def for_run(cls, cfg: Any, run_dir: Path, job_number: int | None, wandb_config: dict[str, Any]) -> "Member | None":
        """The member this job is, with what being one changes in its run.

        Every boundary checkpoint stays (other members may load it), as any the user keeps; W&B's config names the
        member and its board."""
        member = cls.from_environment(cfg, run_dir, job_number, objective_metric(cfg))
        if member is not None:
            cfg.checkpoint.keep_every = math.gcd(cfg.checkpoint.keep_every, member.population.interval)
            wandb_config.update({"population.member": member.number, "population.board": str(member.population.board)})
        return member

    def build(self, values: Mapping[str, Any]) -> Any:
        from tinker_exp.optim import build_plan

        return build_plan(with_values(self.override, values), self.optimizer_cfg, self.total_steps)

    def wants_checkpoint(self, steps_done: int) -> bool:
        """At its boundaries."""
        return self.population.is_boundary(steps_done, self.total_steps)

    def saved(self, steps_done: int, row: Mapping[str, Any], checkpoint: Path) -> Decision:
        """At a boundary: post the score and checkpoint, decide, and on an exploit explore the donor's values.

        The checkpoint is the one saved at this step; the explored values make a new plan. Records the row of
        population.jsonl and override/realized.yaml. One log line."""
        score = float(row[self.metric])
        earlier = [r for r in population_rows(self.run_dir) if r["step"] < steps_done]
        start = None if not earlier else (  # what these steps trained from: the donor's post, or its own previous one
            {"member": earlier[-1]["exploit"]["member"], "step": earlier[-1]["exploit"]["step"]} if earlier[-1].get("exploit")
            else {"member": self.number, "step": earlier[-1]["step"]}
        )  # fmt: skip
        post(self.population.board, self.number, steps_done, score, checkpoint, self.values, self.sign, start)
        wait_for_forced_donor(self.population, self.number, steps_done)
        decision = decide(self.population, self.number, steps_done, posts_at(self.population.board, steps_done))
        previous, exploit, turn = self.values, None, continue_from(self.plan)
        said = "carries on"
        if decision.donor is not None:
            donor = decision.donor
            explore = pb2_explored if self.population.explore == "pb2" else lambda *args: (explored(*args), "")
            proposed, note = explore(donor["values"], self.population, self.number, steps_done, self.override, self.total_steps)
            self.values, self.plan = self.valid(donor["values"], proposed)
            exploit = {"member": int(donor["member"]), "step": int(donor["step"]), "checkpoint": donor["checkpoint"]}
            loop_state = read_json(Path(donor["checkpoint"]) / "loop.json") or {}
            turn = continue_from(self.plan, Path(donor["checkpoint"]), loop_state.get("nonfinite_steps"))
            changes = ", ".join(
                f"{key.removeprefix('override.')} {_short(donor['values'][key])} -> {_short(self.values[key])}" for key in self.values
            )
            said = f"exploit member {exploit['member']} at step {exploit['step']}, {changes}" + (f" ({note})" if note else "")
        record = {"step": steps_done, "score": score, "rank": decision.rank, "of": decision.of, "exploit": exploit,
                  "values": self.values, "previous": previous}  # fmt: skip
        rows = [r for r in population_rows(self.run_dir) if r["step"] < steps_done] + [record]
        write_atomically(self.run_dir / POPULATION_FILE, "".join(json.dumps(r) + "\n" for r in rows))
        write_realized(self.run_dir)
        log.info(f"boundary at step {steps_done}: {self.metric} {score:.4g} (rank {decision.rank} of {decision.of}): {said}")
        return turn

    def valid(self, base: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
        """The explored values and their plan, the donor's values given back key by key until the plan's checks pass.

        Where the plan's checks refuse them (e.g. warmup + decay past the end), keys are given back the donor's values
        one at a time, in the space's order, until they pass."""
        candidate = dict(new)
        for key in (None, *self.population.space):
            if key is not None:
                candidate[key] = base[key]
            try:
                return dict(candidate), self.build(candidate)
            except ConfigError as e:
                log.info(f"explore: {e}; {key or 'the first key'} keeps the donor's value")
        raise AssertionError("the donor's own values must give a valid plan")

    def begin(self, start: StartPoint) -> Decision:
        """A member restarted at its newest checkpoint: its values, plan and checkpoint there, as population.jsonl says.

        The checkpoint is the donor's when it exploited at that very step (its own there is from before). A boundary
        saved but never decided (killed in between) is decided now."""
        step, own_checkpoint = start.step, start.checkpoint.path if start.kind == "resume" and start.checkpoint else None
        if step == 0 or own_checkpoint is None:
            return continue_from(self.plan)
        from tinker_exp.train.sinks import keep_rows_before

        if (self.run_dir / METRICS).exists():  # rows of steps it trains again are not its lineage
            keep_rows_before(self.run_dir / METRICS, step)
        rows = [r for r in population_rows(self.run_dir) if r["step"] <= step]
        write_atomically(self.run_dir / POPULATION_FILE, "".join(json.dumps(r) + "\n" for r in rows))
        if rows:
            self.values = dict(rows[-1]["values"])
            self.plan = self.build(self.values)
        if rows and rows[-1]["step"] == step:
            exploit = rows[-1]["exploit"]
            if exploit is None:
                return continue_from(self.plan)
            loop_state = read_json(Path(exploit["checkpoint"]) / "loop.json") or {}
            return continue_from(self.plan, Path(exploit["checkpoint"]), loop_state.get("nonfinite_steps"))
        if self.wants_checkpoint(step):
            last = [r for r in read_jsonl(self.run_dir / METRICS) if r["train/step"] == step - 1]
            if last and self.metric in last[-1]:
                return self.saved(step, last[-1], own_checkpoint)
        return continue_from(self.plan)

    def end(self, sink: TableSink) -> None:
        """The realized schedule (override/realized.yaml) and W&B's table of exploits."""
        log.info(f"population: {len(self.exploits())} exploit(s); the realized schedule: {write_realized(self.run_dir)}")
        sink.attach_table("population/exploits", ["step", "donor", "donor step", "values"], self.exploits())

    def exploits(self) -> list[list[Any]]:
        """[step, donor, donor step, values] of every exploit (W&B's population/exploits table)."""
        return [[r["step"], r["exploit"]["member"], r["exploit"]["step"], json.dumps(r["values"])]
                for r in population_rows(self.run_dir) if r.get("exploit")]  # fmt: skip
