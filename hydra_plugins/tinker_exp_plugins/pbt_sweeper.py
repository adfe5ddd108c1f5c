"""A Hydra sweeper for population-based training (hydra/sweeper=pbt) over tinker_exp runs, on any launcher.

The sweeper's part is small: the space from Hydra's grammar (tinker_exp/sweep/study.py's `search_space`, as the
optuna sweeper reads it), each member's start values drawn from it (seeded), every bad input refused before any
member starts, then the P members launched as one batch of long-lived jobs (job number = member number) with
TINKER_EXP_POPULATION telling each what its population is; or, with hydra.launcher.workers=W on Slurm, run in W
worker jobs that claim them from a ledger in the sweep dir (`PopulationWorker`: a study worker's machinery).
Everything that happens at a boundary (posting to the board, the exploit decision, explore, the in-place checkpoint
load) is the member's own, inside its job
(tinker_exp/sweep/pbt.py and the loop): members never wait for the sweeper or for each other. At the end: the
members ranked by final objective with their exploits and donors, population_results.yaml with the best member's
replay command, and report.png (tinker_exp/sweep/pbt_report.py). Exit 0 when at least one member completed.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, ListConfig, OmegaConf

from hydra_plugins.tinker_exp_plugins.launchers import (
    SweepFailedError,
    check_points,
    job_objective,
    job_run_dir,
    nothing_left_unsubmitted,
    save_multirun,
)
from hydra_plugins.tinker_exp_plugins.optuna_sweeper import StudyWorker
from tinker_exp.errors import ConfigError, TinkerExpError
from tinker_exp.sweep.pbt import EXPLORES, POPULATION_ENV, numeric_keys
from tinker_exp.sweep.slot_count import AUTO

log = logging.getLogger(__name__)

BOARD = "population"  # the board's folder in the sweep dir (one file per post; tinker_exp/sweep/pbt.py)

# What a member cannot change between two of its own steps, and why (the first matching prefix says it).
FROZEN_KEYS = (
    ("model", "the model is built once, when the member's workers start"),
    ("lora", "the LoRA adapters are built once, when the member's workers start"),
    ("optimizer", "the optimizer's class and construction values are fixed when the workers start; "
                  "search the values sent with every step instead (override.lr.value, +override.weight_decay)"),
    ("backend", "the member's workers (their number, nodes, strategy) are started once per job"),
    ("trainer.seed", "every member shares trainer.seed (the data order), so a member's weights follow from its "
                     "lineage's realized schedule alone"),
    ("trainer.steps", "members share their steps: the boundaries are the same steps for all"),
    ("trainer.batch_size", "members share their batches: an exploit continues the donor's data stream"),
    ("data", "every member reads the same data in the same order"),
    ("override", "a preset is chosen once per run; search its parameters instead (override.lr.value=...)"),
)  # fmt: skip


class PopulationFailedError(TinkerExpError):
    """No member completed: the entry point prints the message and nothing else (no Hydra hint), exit status 1."""


def frozen_key_error(key: str) -> str | None:
    """Why PBT cannot search `key` (as written, +/~ allowed), or None for a value a member may change in flight."""
    path = key.lstrip("+~")
    for prefix, why in FROZEN_KEYS:
        if path == prefix or path.startswith(prefix + "."):
            if prefix == "override" and path != prefix:
                return None  # override.<key>[.<param>]: a value the plan sends with every step
            return f"hydra.sweeper.params: {key}: cannot change within a run: {why}"
    return (
        f"hydra.sweeper.params: {key}: not a value sent with every optimizer step; PBT searches override.* keys "
        "(plain values such as +override.weight_decay and schedule parameters such as override.lr.value)"
    )


def missing_key_error(config: DictConfig, key: str, written: str) -> str | None:
    """The error for a key without + that the selected override does not set, said once for the space.

    Not per member with a sampled value: each member's compose would fail on it."""
    if key.startswith(("+", "~")) or OmegaConf.select(config, key, default=_MISSING) is not _MISSING:
        return None
    if OmegaConf.select(config, "override") is None:
        return f"hydra.sweeper.params: {key}={written}: no override is selected; select a preset first (+override=NAME)"
    return (f"hydra.sweeper.params: {key}={written}: the selected override does not set {key.removeprefix('override.')}; "
            f"type '+{key}={written}' (the + adds a key the file does not set)")  # fmt: skip


_MISSING = object()


def settings_error(population: Any, interval: Any, quantile: Any, perturb: Any, resample_probability: Any, seed: Any) -> str | None:
    """The first of hydra.sweeper's PBT keys that is wrong, as one line; None when all are right."""

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def is_number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if not is_int(population) or population < 2:
        return f"hydra.sweeper.population: {population!r} must be an int >= 2 (a population exploits its other members)"
    if not is_int(interval) or interval < 1:
        return f"hydra.sweeper.interval: {interval!r} must be an int >= 1 (steps between boundaries)"
    if not is_number(quantile) or not 0 < quantile <= 0.5:
        return f"hydra.sweeper.quantile: {quantile!r} must be in (0, 0.5] (the share of members that exploit the top ones)"
    factors = list(perturb) if isinstance(perturb, (list, tuple, ListConfig)) else None
    if not factors:
        return f"hydra.sweeper.perturb: {perturb!r} must be a non-empty list of factors, e.g. [0.8, 1.2]"
    for factor in factors:
        if not is_number(factor) or factor <= 0:
            return f"hydra.sweeper.perturb: {factor!r} in {factors} must be a number > 0 (a factor a kept value is multiplied by)"
    if not is_number(resample_probability) or not 0 <= resample_probability <= 1:
        return f"hydra.sweeper.resample_probability: {resample_probability!r} must be in [0, 1]"
    if not is_int(seed):
        return f"hydra.sweeper.seed: {seed!r} must be an int"
    return None


def boundary_error(cfg: Any, interval: int) -> str | None:
    """Why the members' config cannot have a boundary every `interval` steps that is an evaluation step, or None.

    `cfg`: a member's typed config (what PBT needs of it is the same for every member: none of it is searched)."""
    from tinker_exp.train.evaluation import missing_evaluation_data

    trainer = cfg.trainer
    if why := missing_evaluation_data(cfg):
        return f"hydra.sweeper=pbt: members are scored at evaluations, and {why}"
    if not trainer.eval_every:
        return (f"hydra.sweeper.interval={interval}: trainer.eval_every=0 evaluates only after the last step; each "
                "boundary must be an evaluation step")  # fmt: skip
    if interval % trainer.eval_every:
        return (f"hydra.sweeper.interval={interval}: not a multiple of trainer.eval_every={trainer.eval_every}; each "
                "boundary must be an evaluation step")  # fmt: skip
    if trainer.steps < 2 * interval:
        return (f"hydra.sweeper.interval={interval}: trainer.steps={trainer.steps} leaves no boundary to train on "
                f"from (needs trainer.steps >= 2 * interval = {2 * interval})")  # fmt: skip
    return None


def force_exploit_error(force: Any, population: int, interval: int, steps: int) -> str | None:
    """hydra.sweeper.force_exploit (test-only): null, or {member, step, donor} naming two members and a boundary."""
    if force is None:
        return None
    shown = dict(force) if isinstance(force, Mapping) else force
    if not isinstance(force, Mapping) or set(force) != {"member", "step", "donor"}:
        return f"hydra.sweeper.force_exploit: {shown!r} must be null or {{member: m, step: s, donor: d}}"
    member, step, donor = force["member"], force["step"], force["donor"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (member, step, donor)):
        return f"hydra.sweeper.force_exploit: {shown!r}: member, step and donor must be ints"
    if not (0 <= member < population and 0 <= donor < population) or member == donor:
        return f"hydra.sweeper.force_exploit: {shown!r}: member and donor must be two members in 0..{population - 1}"
    if step <= 0 or step % interval or step >= steps:
        return f"hydra.sweeper.force_exploit: {shown!r}: step {step} is not a boundary (a multiple of {interval} below trainer.steps={steps})"
    return None


def start_values(space: Mapping[str, Any], population: int, seed: int) -> list[dict[str, Any]]:
    """Each member's start values: drawn uniformly from the space (log-uniform on log dimensions), seeded."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    draws = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    return [draws.ask(dict(space)).params for _ in range(population)]


class PBTSweeper(Sweeper):
    def __init__(
        self,
        population: int,
        interval: int,
        quantile: float,
        perturb: Sequence[float],
        resample_probability: float,
        seed: int,
        params: dict[str, str] | None = None,
        force_exploit: Mapping[str, int] | None = None,
        explore: str = "perturb",
    ) -> None:
        self.population, self.interval, self.quantile = population, interval, quantile
        self.perturb = list(perturb) if isinstance(perturb, (list, tuple, ListConfig)) else perturb
        self.resample_probability, self.seed = resample_probability, seed
        self.params = dict(params or {})
        self.explore = explore
        self.force_exploit = OmegaConf.to_container(force_exploit) if isinstance(force_exploit, DictConfig) else force_exploit

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        # Checked here, not in __init__: Hydra would wrap an error raised there in its own, over several lines.
        error = settings_error(self.population, self.interval, self.quantile, self.perturb, self.resample_probability, self.seed)
        if not error and self.explore not in EXPLORES:
            error = f"hydra.sweeper.explore: {self.explore!r} must be one of {', '.join(EXPLORES)} (perturb: PBT's; pb2: a GP bandit)"
        if error:
            raise ConfigError(error)
        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context, task_function=task_function, config=config)
        if hasattr(self.launcher, "summarize"):  # ours: the population's table at its end, not the launcher's
            self.launcher.summarize = False
        if hasattr(self.launcher, "keep_saved_states"):  # ours: members on slots exploit each other in place
            self.launcher.keep_saved_states = True

    def sweep(self, arguments: list[str]) -> Any:
        from optuna.distributions import distribution_to_json

        from tinker_exp.sweep.study import trial_label

        fixed, space, starts, points, cfg = self._checked_members(arguments)  # raises before anything is written
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        made_now = not sweep_dir.exists()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        save_multirun(self.config, sweep_dir)
        log.info(
            f"population of {self.population}, a boundary every {self.interval} steps of {cfg.trainer.steps}; "
            f"the bottom {self.quantile:g} exploit the top, explored by {self.explore}; search space: " + ", ".join(f"{k}: {dimension(d)}" for k, d in space.items())
        )
        for member, values in enumerate(starts):
            log.info(f"member {member} starts with {trial_label(values)}")
        told = {
            "board": str(sweep_dir / BOARD),
            "population": self.population,
            "interval": self.interval,
            "quantile": float(self.quantile),
            "perturb": [float(f) for f in self.perturb],
            "resample_probability": float(self.resample_probability),
            "seed": self.seed,
            "space": {key.lstrip("+~"): distribution_to_json(d) for key, d in space.items()},
            "force_exploit": self.force_exploit,
            "explore": self.explore,
        }
        # each member's job gets it (local: its process; Slurm: sbatch's); sbatch taking no job leaves nothing behind
        with environment(POPULATION_ENV, json.dumps(told)), nothing_left_unsubmitted(sweep_dir, made_now):
            returns = self._run_on_workers(sweep_dir, points, fixed, space) if self._workers(cfg) else self._launch(points)
        if cfg.dry_run:  # each member checked and planned with its start values (plan.json); nothing trained
            log.info(f"dry run: {self.population} members planned in {sweep_dir}; nothing trained")
            return {}
        return self._finish(sweep_dir, fixed, space, starts, points, returns)

    def _checked_members(self, arguments: list[str]) -> tuple[list[str], dict[str, Any], list[dict[str, Any]], list[list[str]], Any]:
        """(the fixed overrides, the space, each member's start values and overrides, member 0's typed config).

        Returned once every check passed: the space, every member's point (as any run's), the boundaries,
        force_exploit."""
        from tinker_exp.sweep.study import as_override, expression, search_space

        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides([f"{k}={v}" for k, v in self.params.items()] + arguments)
        fixed, space = search_space(overrides)
        if not space:
            raise ConfigError(
                "hydra.sweeper.params: no search space; give one in hydra.sweeper.params or on the command line, "
                "e.g. 'override.lr.value=tag(log, interval(1e-4, 3e-3))'"
            )
        written = {o.get_key_element(): expression(o) for o in overrides if o.is_sweep_override()}
        errors = [frozen_key_error(key) for key in space] + [missing_key_error(self.config, key, written[key]) for key in space]
        for error in errors:  # a key that cannot be searched is said before a key that lacks its +
            if error:
                raise ConfigError(error)
        if self.explore == "pb2" and not numeric_keys(space):
            raise ConfigError(
                f"hydra.sweeper.explore=pb2: its GP models numeric keys, and the space has only choices ({', '.join(space)}); "
                "use explore=perturb or search a number too"
            )
        starts = start_values(space, self.population, self.seed)
        points = [[*fixed, *(as_override(key, value) for key, value in values.items())] for values in starts]
        job_points = self.launcher.job_points(points) if hasattr(self.launcher, "job_points") else points
        workers = self._workers(self.config)
        # every bad member named, one that cannot take the slots asked for too (local, or on workers)
        slots = self.launcher.point_slots() if hasattr(self.launcher, "point_slots") else 1
        configs = check_points(self.hydra_context, self.config, job_points, 0, slots)
        if workers and hasattr(self.launcher, "decide_slots"):  # auto: each worker's share at once, where they can share a group
            self.launcher.decide_slots(configs, math.ceil(self.population / workers), space)
        auto = self.config.hydra.launcher.get("slots") == AUTO
        if error := workers_error(workers, self._worker_slots(), self.population, auto):
            raise ConfigError(error)
        cfg = configs[0]
        # What PBT needs of the config is the same for every member: none of it can be searched.
        for error in (
            boundary_error(cfg, self.interval),
            force_exploit_error(self.force_exploit, self.population, self.interval, cfg.trainer.steps),
        ):
            if error:
                raise ConfigError(error)
        return fixed, space, starts, points, cfg

    def _workers(self, cfg: Any) -> int:
        """Population worker jobs (hydra.launcher.workers on Slurm).

        0: a job per member. A dry run keeps a job per member (each plans its point; nothing trains, so nothing to
        share)."""
        return 0 if cfg.dry_run or not hasattr(self.launcher, "workers") else self.launcher.workers()

    def _worker_slots(self) -> int:
        """Members a population worker trains at once (hydra.launcher.slots; 1: one on its warm workers)."""
        return self.launcher.worker_slots() if hasattr(self.launcher, "worker_slots") else 1

    def _run_on_workers(
        self, sweep_dir: Path, points: Sequence[Sequence[str]], fixed: Sequence[str], space: Mapping[str, Any]
    ) -> list[JobReturn]:
        """The members on `workers` Slurm jobs (one sbatch); every member's JobReturn, as `_launch`'s.

        Each member is claimed from a ledger in the sweep dir by one worker (tinker_exp/sweep/workers.py `items_study`),
        which runs it as its own job would (run dir, number, files); the sweep waits as a study on workers does
        (`run_workers`): a member whose worker is gone runs again in its run dir, from its newest checkpoint, on a
        worker with room."""
        from hydra_plugins.tinker_exp_plugins.optuna_sweeper import run_workers
        from tinker_exp.sweep.slurm import cancel_slurm_jobs
        from tinker_exp.sweep.workers import ITEM, ITEMS_JOURNAL, items_study, workers_of_earlier_launches

        earlier = workers_of_earlier_launches(sweep_dir, LEDGER)  # a killed sweep's workers may run its members still
        if earlier and cancel_slurm_jobs(earlier):
            log.info(f"cancelled the worker jobs of the population's earlier launch: {', '.join(earlier)}")
        ledger = items_study(sweep_dir, self.population, LEDGER)
        storage = f"journal://{sweep_dir / ITEMS_JOURNAL}"
        worker = PopulationWorker(self.launcher, storage, ledger.study_name, points, fixed, space)
        count, slots = self.launcher.workers(), self._worker_slots()
        what = f"each trains {slots} members at once on slots of one group" if slots > 1 else "each trains a member on warm workers"
        run_workers(self.launcher, ledger, worker, count, self.population, sweep_dir, member_line, "population workers", what,
                    label=lambda trial: f"member {trial.params[ITEM]}")  # fmt: skip
        return [member_return(ledger, member, overrides) for member, overrides in enumerate(points)]

    def _launch(self, points: Sequence[Sequence[str]]) -> Sequence[JobReturn]:
        """Every member at once, as one batch of jobs (local: max_parallel at a time; Slurm: one job array).

        Our launchers raise at a failed job (right for a grid); a population goes on with the others."""
        try:
            return self.launcher.launch(points, initial_job_idx=0)
        except SweepFailedError as e:
            return e.returns

    def _finish(self, sweep_dir: Path, fixed: Sequence[str], space: Mapping[str, Any], starts: Sequence[Mapping[str, Any]],
                points: Sequence[Sequence[str]], returns: Sequence[JobReturn]) -> dict[str, Any]:  # fmt: skip
        """The members ranked, and the population's files: population_results.yaml, the replay line, report.png.

        The members ranked: table printed, summary.md/jsonl. Raises PopulationFailedError when no member completed."""
        from tinker_exp.sweep import pbt_report

        outcomes = getattr(self.launcher, "outcomes", {})  # ours: the scheduler's word for a job it ended
        members = []
        for member, (overrides, ret) in enumerate(zip(points, returns)):
            run_dir = job_run_dir(self.hydra_context, self.config, overrides, member)
            value, error = job_objective(ret)
            ended = outcomes[member].status if member in outcomes and outcomes[member].status != "COMPLETED" else None
            start = {key.lstrip("+~"): v for key, v in starts[member].items()}
            members.append(pbt_report.read_member(member, start, run_dir, value, error, ended))
        for member in members:
            if member.error:
                log.warning(f"member {member.member} failed: {member.error}; run dir {member.run_dir}")
        summary = pbt_report.write_summary(sweep_dir, members)
        choices = OmegaConf.select(self.config, "hydra.runtime.choices") or {}
        results = pbt_report.results(members, fixed, self.population, self.interval, choices.get("override") is not None)
        OmegaConf.save(OmegaConf.create(results), sweep_dir / pbt_report.RESULTS_FILE)
        log_scale = {key.lstrip("+~"): bool(getattr(d, "log", False)) for key, d in space.items()}
        report = pbt_report.write_report(members, log_scale, sweep_dir / pbt_report.REPORT, f"population {pbt_report.display_name(sweep_dir)}")
        log.info(f"population summary ({', '.join(str(p) for p in (summary, report) if p)}):\n{pbt_report.table(members)}")
        if results["best_member"] is None:
            raise PopulationFailedError(f"none of the {self.population} members completed; {sweep_dir / pbt_report.RESULTS_FILE}")
        log.info(
            f"best member {results['best_member']}: {results['best_objective']:.6g} "
            f"({results['n_completed']} of {self.population} members completed); {sweep_dir / pbt_report.RESULTS_FILE}"
        )
        log.info(f"replay the best member from step 0: {results['replay_command']}")
        return results


LEDGER = "population"
"""The members' ledger in the sweep dir's items.journal (tinker_exp/sweep/workers.py): `population-<launch>`."""


def workers_error(workers: int, slots: int, population: int, auto: bool = False) -> str | None:
    """Why `workers` jobs of `slots` slots each cannot train the population's members side by side, or None.

    `auto`: what hydra.launcher.slots=auto came to; 0 workers: a job a member. Members rank against each other at every
    boundary, so all must train at once: a member left to wait for another's end would decide alone (its peers' posts
    long written) and train after them."""
    if not workers or workers * slots >= population:
        return None
    asked = f"hydra.launcher.slots=auto ({slots} here)" if auto else f"hydra.launcher.slots={slots}"
    return (f"hydra.launcher.workers={workers} with {asked}: {workers * slots} members train at once, and the population's "
            f"{population} train side by side; set workers * slots >= {population} (slots hold LoRA members)")  # fmt: skip


def member_return(ledger: Any, member: int, overrides: Sequence[str]) -> JobReturn:
    """What a member came to on the workers, as its job's JobReturn.

    Its last run's objective, or why it failed (lost past its retries, cut off, or never run because every worker ended
    first)."""
    from hydra.core.utils import JobStatus
    from optuna.trial import TrialState

    from tinker_exp.sweep.study import trial_error
    from tinker_exp.sweep.workers import ITEM

    runs = [t for t in ledger.get_trials(deepcopy=False) if t.params.get(ITEM, t.system_attrs.get("fixed_params", {}).get(ITEM)) == member]
    last = runs[-1] if runs else None
    if last is not None and last.state == TrialState.COMPLETE:
        return JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=last.value)
    if last is None or last.state in (TrialState.WAITING, TrialState.RUNNING):
        why = "not run: every population worker ended first"
    else:
        why = trial_error(last)
    return JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=why)


def member_line(trial: Any) -> None:
    """One line as a member's run on a worker ends: its objective or why it failed, its run dir."""
    from optuna.trial import TrialState

    from tinker_exp.sweep.study import trial_error
    from tinker_exp.sweep.workers import ITEM

    member, run_dir = trial.params[ITEM], trial.user_attrs.get("run_dir")
    if (trial_error(trial) or "").startswith("lost: "):
        return  # said as the sweep lost it (tinker_exp.sweep.workers.lose), with what it did about it
    if trial.state == TrialState.COMPLETE:
        log.info(f"member {member}: completed, objective {trial.value:.6g}; run dir {run_dir}")
    else:
        log.warning(f"member {member} failed: {trial_error(trial)}; run dir {run_dir}")


class PopulationWorker(StudyWorker):
    """A population worker job's work: a study worker's, whose trials are the members it claims from the ledger.

    A study worker: warm workers started once in its allocation, K loops on slots. Its trials are the members it claims
    from the population's ledger (each once, a lost one again), each run as its own job would run it: its point, job
    number = member number, its run dir."""

    who, items = "population worker", "members"

    def __init__(self, launcher: Any, storage: str, study_name: str, points: Sequence[Sequence[str]], fixed: Sequence[str],
                 space: Mapping[str, Any]) -> None:  # fmt: skip
        from hydra.core.singleton import Singleton

        self.launcher, self.storage, self.study_name = launcher, storage, study_name
        self.points, self.n_trials = [list(p) for p in points], len(points)
        self.fixed, self.space = list(fixed), dict(space)  # the slots were decided by the sweep: `decide_study_slots` keeps them
        self.singleton_state = Singleton.get_state()  # Hydra's state, as each job of the launcher gets it

    def ask(self, study: Any) -> Any:
        from tinker_exp.sweep.workers import ask_item

        return ask_item(study, self.n_trials)

    def point(self, study: Any, trial: Any) -> tuple[list[str], int, str]:
        """(the member's point, its number as the job number, its name).

        A lost member run again waits for the run dir lock its lost run left (another host: until it is stale), so that
        it resumes rather than being refused."""
        from tinker_exp.sweep.workers import ITEM, RETRY_OF, lost_lock_freed

        member = trial.params[ITEM]
        if RETRY_OF in trial.user_attrs:
            lost_lock_freed(job_run_dir(self.launcher.hydra_context, self.launcher.config, self.points[member], member))
        return self.points[member], member, f"member {member}"


def dimension(d: Any) -> str:
    """A search dimension as the grammar writes it: tag(log, interval(0.0001, 0.003)), choice(a, b), ..."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(d, CategoricalDistribution):
        return f"choice({', '.join(map(str, d.choices))})"
    step = f" step {d.step}" if isinstance(d, IntDistribution) and d.step != 1 else ""
    text = f"{'int(' if isinstance(d, IntDistribution) else ''}interval({d.low:g}, {d.high:g}){')' if isinstance(d, IntDistribution) else ''}{step}"
    return f"tag(log, {text})" if d.log else text


@contextmanager
def environment(name: str, value: str) -> Iterator[None]:
    """`name` set to `value` within; afterwards as before (a sweep run in a test's process leaves it unchanged)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before

