"""A worker group kept warm across runs (the pool's: tinker_exp/pool/), built once per key.

Every run it is lent to starts from exactly the state a cold build of its command leaves (runtime/workers.py
`fresh_engine`).

What needs a new group is what the workers are built with, less what a run sends: its optimizer values and seed
(`group_key`): the config's worker settings, the model's files as they are now, and the environment that reaches
the workers. Several groups are kept, one a key (`KeptGroups`): a run whose key no kept group has gets one built
for it, the least recently used freed first when it would not fit (a count, a memory budget, the cluster's
workers); on a new Ray cluster, without the others, when the workers' environment differs (Ray's processes keep
the one they started with); a group whose workers died is built again; each said in one line, in order.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tinker_exp.config import Config
from tinker_exp.memory import default_memory_budget_mb
from tinker_exp.runtime.worker_output import WorkerOutput
from tinker_exp.runtime.slots import Slot, SlotGroup
from tinker_exp.runtime.workers import TinkerWorkers

log = logging.getLogger(__name__)

BuildWorkers = Callable[[Config, Any, Path, Path, Any], TinkerWorkers]
"""(config, plan, model dir, run dir, device choice) -> the worker group, starting: a cold run's (assemble.verl_workers)."""


PER_RUN_BACKEND = ("pool", "nodes_timeout_s", "ray_address")
"""backend keys that do not shape the workers (the group's Ray cluster is the pool's)."""


def group_key(cfg: Config, model_path: Path, choice: Any, worker_env: dict[str, str], worker: str | None = None) -> dict[str, Any]:
    """What the workers of a run like `cfg` are built with, less what a fresh state sets per run: its group's key.

    The workers' config is runtime/workers.py `worker_config`; a fresh state sets the optimizer values, seed, steps and
    gradient clip. Two runs with the same key share a group. `worker_env`: the run's environment that reaches the
    workers (place/wire.py `worker_environment`); `worker`: the worker class's name where it is not a run's (the
    server's)."""
    backend = {k: v for k, v in dataclasses.asdict(cfg.backend).items() if k not in PER_RUN_BACKEND}
    rl = cfg.rl
    return {
        "worker": worker or ("TinkerActorRolloutRefWorker" if cfg.env.active else "TinkerTrainingWorker"),
        "model": str(model_path),
        "model_files": model_fingerprint(model_path),
        "worker_env": dict(worker_env),
        "device": choice.describe(),
        "backend": {k: getattr(v, "value", v) for k, v in backend.items()},
        "lora": dataclasses.asdict(cfg.lora) if cfg.lora.rank > 0 else None,
        "optimizer": cfg.optimizer.name.value,
        "rl_batch": (rl.prompts_per_step, rl.group_size) if cfg.env.active else None,
    }


def slot_group_key(cfg: Config, model_path: Path, choice: Any) -> dict[str, Any]:
    """A slot group's key: its group's (`group_key`), and for RL trials the loss and RL settings the group installs.

    For RL trials the group installs them once for all its slots (runtime/rl_workers.py `RLWorkers`: its loss, its
    batches' sampling temperature)."""
    key = group_key(cfg, model_path, choice, {})
    if cfg.env.active:
        key.update(rl=dataclasses.asdict(cfg.rl), loss=dataclasses.asdict(cfg.loss))
    return key


def model_fingerprint(model_path: Path) -> str:
    """The model dir's files as they are now (each file's name, size and change time; cheap, no read).

    Weights replaced at the same path are not the ones the kept workers loaded."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(p for p in Path(model_path).rglob("*") if p.is_file()):
        info = path.stat()
        digest.update(f"{path.relative_to(model_path)}:{info.st_size}:{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def key_difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The first few values that differ between two keys, as `name: old -> new` (flattened names)."""

    def flat(value: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(value, dict):
            return {k: v for name, item in value.items() for k, v in flat(item, f"{prefix}{name}.").items()}
        return {prefix.rstrip("."): value}

    a, b = flat(old), flat(new)
    changed = [f"{name}: {a.get(name)!r} -> {b.get(name)!r}" for name in sorted(a.keys() | b.keys()) if a.get(name) != b.get(name)]
    return "; ".join(changed[:3]) + (f" (and {len(changed) - 3} more)" if len(changed) > 3 else "")


def describe_key(key: dict[str, Any]) -> str:
    """One line: the worker class, model, device and what the group trains."""
    trains = f"LoRA rank {key['lora']['rank']}" if key["lora"] else "full fine-tuning"
    workers = key["backend"]["num_workers"] * key["backend"]["nodes"]
    return f"{workers} x {key['worker']} on {key['device']}; model {key['model']}; {trains}; {key['optimizer']}"


class Lent:
    """The group as one run sees it: the worker group's calls, but `shutdown` gives it back instead of freeing it.

    `built`: whether the group was built for this run."""

    def __init__(self, workers: TinkerWorkers, built: bool) -> None:
        self._workers, self._built = workers, built

    def __getattr__(self, name: str) -> Any:
        return getattr(self._workers, name)

    def ready(self) -> None:
        if not self._built:  # a group built for this run said where its workers are, and what they hold, as it was built
            log.info(f"workers: {self._workers.placement} (kept warm by the pool, in the state a cold build leaves)")
            self._workers.say_installed()

    def shutdown(self) -> None:
        if self._workers.output is not None:
            self._workers.output.stop()


def kept_words(kept: Kept) -> str:
    """A kept group as a run's line names it, once the run is counted among its runs."""
    before = kept.runs - 1
    return f"a kept group (built {time.strftime('%H:%M:%S', time.localtime(kept.built_at))}, {before} run{'s' * (before != 1)} before)"


MAX_GROUPS = 4
"""How many worker groups a pool keeps at most (`pool up --max-groups`); the least recently used is freed first."""
@dataclass
class Kept:
    """A worker group kept for its key."""

    key: dict[str, Any]
    workers: Any
    """The worker group (runtime/workers.py TinkerWorkers, or the server's ServeWorkers)."""
    built_at: float
    pids: list[int]
    """Each rank's process."""
    size_mb: float
    """Its workers' resident memory, measured right after its build (weights, their kept copy, optimizer)."""
    slots: float
    """What it holds of the Ray cluster: its workers (one CPU, or one GPU, each)."""
    runs: int = 0
    last_used: float = field(default_factory=time.time)
    slot_group: Any = None
    """Its slots (runtime/slots.py SlotGroup), once runs on slots use it (`WarmGroups.slot_group`)."""


class KeptGroups:
    """Worker groups kept by key while they fit, the least recently used freed first.

    At most `max_groups`, their measured memory within `memory_budget_mb`, their workers within the Ray cluster's
    `capacity` (CPUs on a CPU machine, GPUs on a GPU one). What is freed and why is said in one line. Used by the pool
    (`WarmGroups`) and by the Tinker server (serve/__main__.py)."""

    def __init__(self, max_groups: int, memory_budget_mb: float | None, say: Callable[[str], None]) -> None:
        """`say`: how a line is said (the pool's log, the server's stderr)."""
        self.max_groups = max_groups
        self.memory_budget_mb = memory_budget_mb if memory_budget_mb is not None else default_memory_budget_mb()
        self.say = say
        self.groups: dict[str, Kept] = {}  # least recently used first
        self.capacity: float | None = None
        """The Ray cluster's workers at most (None: not bounded here)."""

    @staticmethod
    def name(key: dict[str, Any]) -> str:
        return json.dumps(key, sort_keys=True, default=str)

    def find(self, key: dict[str, Any]) -> Kept | None:
        return self.groups.get(self.name(key))

    def use(self, kept: Kept) -> None:
        """`kept` is the most recently used now."""
        self.groups[self.name(kept.key)] = self.groups.pop(self.name(kept.key))
        kept.runs += 1
        kept.last_used = time.time()

    def make_room(self, key: dict[str, Any], slots: float) -> None:
        """Before a group for `key` is built: the least recently used freed while the new one would not fit.

        The new one's memory is estimated as the largest kept group's."""
        estimate = max((kept.size_mb for kept in self.groups.values()), default=0.0)
        while self.groups:
            held = sum(kept.size_mb for kept in self.groups.values())
            workers = sum(kept.slots for kept in self.groups.values())
            if len(self.groups) >= self.max_groups:
                why = f"{len(self.groups)} groups kept, --max-groups {self.max_groups}"
            elif held + estimate > self.memory_budget_mb:
                why = f"{held:.0f} MiB kept + about {estimate:.0f} MiB for the new one > the budget of {self.memory_budget_mb:.0f} MiB"
            elif self.capacity is not None and workers + slots > self.capacity:
                why = f"{workers:g} workers kept + {slots:g} new > the cluster's {self.capacity:g}"
            else:
                return
            oldest = next(iter(self.groups.values()))
            self.free(oldest, f"the least recently used ({why})")

    def add(self, kept: Kept) -> None:
        """`kept` kept, the most recently used."""
        self.groups[self.name(kept.key)] = kept
        kept.last_used = time.time()

    def take(self, kept: Kept) -> Any:
        """`kept`'s workers, out of the kept groups while someone holds them.

        Someone: the server's client; `add` gives them back, the most recently used."""
        self.groups.pop(self.name(kept.key), None)
        kept.runs += 1
        return kept.workers

    def free(self, kept: Kept, why: str) -> None:
        self.groups.pop(self.name(kept.key), None)
        self.say(f"freed a group, {why}: {describe_key(kept.key)}")
        kept.workers.shutdown()

    def forget_all(self) -> list[Kept]:
        """Every group, out of the books (the caller frees them, or their cluster ends with them)."""
        groups, self.groups = list(self.groups.values()), {}
        return groups


def resident_mb(pids: list[int]) -> float:
    """The processes' resident memory together, in MiB (0 for one not found)."""
    return sum(rss_mb(pid) or 0.0 for pid in pids)


def rss_mb(pid: int | None) -> float | None:
    """A process's resident memory in MiB (Linux's /proc), None if unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class WarmGroups:
    """The pool's worker groups, kept by key (`KeptGroups`), lent one run at a time.

    Each run is lent the group of its key, built for it if none is kept (the least recently used freed first when the
    new one would not fit), one run at a time."""

    def __init__(self, build: BuildWorkers, workers_log: str, max_groups: int = MAX_GROUPS,
                 memory_budget_mb: float | None = None, where: str = "the pool") -> None:  # fmt: skip
        """The pool's groups, each built by `build` and lent to runs.

        `build`: a cold run's worker group; `workers_log`: the file in a run dir that gets what the workers print;
        `where`: the pool, as a run's line names it."""
        self.build, self.workers_log, self.where = build, workers_log, where
        self.kept = KeptGroups(max_groups, memory_budget_mb, say=lambda line: log.info(f"pool: {line}"))
        self.runs = 0
        self.worker_env: dict[str, str] = {}
        """The environment of the run being served that reaches the workers (set by the pool for each run)."""
        self.cluster_env: dict[str, str] | None = None
        """The worker environment the pool's Ray cluster was started with (None: no cluster yet)."""

    def lend(self, cfg: Config, plan: Any, model_path: Path, run_dir: Path) -> Lent:
        """The group for this run, in the state a cold start of it leaves: the kept one of its key, else a new one.

        What the workers print goes to the run dir from now on."""
        output = WorkerOutput(run_dir / self.workers_log, echo=cfg.verbose)

        def start_fresh() -> tuple[Kept, bool]:
            kept, built = self.prepare(cfg, plan, model_path, run_dir)
            kept.workers.for_run(cfg)  # an RL run's own loss, not the first run's
            kept.workers.start_fresh(cfg.optimizer, cfg.trainer, plan.optimizer_values, output)
            return kept, built

        try:
            kept, built = start_fresh()
        except Exception as e:
            if not is_dead_worker(e):
                raise
            log.info(f"pool: a worker had died ({type(e).__name__}); building the group again")
            dead = self.kept.find(group_key(cfg, model_path, self.choice(cfg), self.worker_env))
            if dead is not None:
                self.kept.free(dead, "its worker died")
            kept, built = start_fresh()
        self.kept.use(kept)
        self.runs += 1
        groups = len(self.kept.groups)
        if built:
            where = f"the workers just built on {self.where}"
        else:
            where = f"the warm workers of {self.where}: {kept_words(kept)}"
        log.info(f"pool: training on {where}; {groups} group{'s' * (groups != 1)} kept")
        return Lent(kept.workers, built)

    def has_group_for(self, cfg: Config, worker_env: dict[str, str]) -> bool:
        """Whether a group for runs like `cfg` is kept: a sweep's job asks before it picks a pool.

        `worker_env`: the runs' environment that reaches the workers. A model not on this machine yet (a hub id not
        downloaded) has none."""
        from tinker_exp.config.validate import resolve_model_path
        from tinker_exp.runtime.inputs import model_dir

        model_path = resolve_model_path(cfg.model.path, download=False) if cfg.model.path else model_dir(cfg.model)
        return model_path is not None and self.kept.find(group_key(cfg, model_path, self.choice(cfg), worker_env)) is not None

    @staticmethod
    def choice(cfg: Config) -> Any:
        from tinker_exp.runtime.device import resolve

        return resolve(cfg.backend)

    def prepare(self, cfg: Config, plan: Any, model_path: Path, out_dir: Path) -> tuple[Kept, bool]:
        """The group for runs like `cfg` (and whether it was built now): the kept one of its key, else one built now.

        What a build prints goes into `out_dir`."""
        choice = self.choice(cfg)
        key = group_key(cfg, model_path, choice, self.worker_env)
        kept = self.kept.find(key)
        if kept is not None:
            return kept, False
        closest = next(reversed(self.kept.groups.values()), None)
        log.info(f"pool: no kept group fits this run" + (f" (the last used: {key_difference(closest.key, key)})" if closest else "")
                 + "; building one")  # fmt: skip
        if self.cluster_env is not None and self.cluster_env != key["worker_env"]:
            # Ray's processes keep the environment they started with: a new cluster for this one, without the groups
            log.info(f"pool: the workers' environment differs ({key_difference(self.cluster_env, key['worker_env'])}): "
                     f"{len(self.kept.groups)} group(s) freed with the pool's Ray cluster")  # fmt: skip
            self.stop_cluster()
        workers_each = cfg.backend.num_workers * cfg.backend.nodes
        self.kept.make_room(key, workers_each)
        started = time.monotonic()
        start_own_cluster(choice.device, self.kept.max_groups)
        self.kept.capacity = cluster_capacity(choice.device)
        self.cluster_env = key["worker_env"]
        workers = self.build(cfg, plan, model_path, out_dir, choice)
        workers.owns_ray = False  # the pool's cluster outlives its groups: freeing one frees its actors only
        try:
            workers.ready()
            workers.keep_initial_state()
        except BaseException:
            workers.shutdown()
            raise
        pids = [info["pid"] for info in workers.group.device_info()]
        kept = Kept(key, workers, time.time(), pids, resident_mb(pids), workers_each)
        self.kept.add(kept)
        log.info(f"pool: group built in {time.monotonic() - started:.1f} s ({kept.size_mb:.0f} MiB): {describe_key(key)}")
        return kept, True

    def slot_group(self, cfg: Config, plan: Any, model_path: Path, out_dir: Path, capacity: int) -> tuple[SlotGroup, str]:
        """The slots of the group for runs like `cfg` (LoRA SFT), built now if none is kept, and how it came to be.

        What a build prints goes into `out_dir`; how it came to be is said as a run's line says it."""
        kept, built = self.prepare(cfg, plan, model_path, out_dir)
        if kept.slot_group is None:
            kept.slot_group = SlotGroup(kept.workers, capacity)
        self.kept.use(kept)
        self.runs += 1
        return kept.slot_group, "a group built for this run" if built else kept_words(kept)

    def slot_group_for(self, cfg: Config, worker_env: dict[str, str]) -> tuple[SlotGroup, str] | None:
        """The slots of the kept group for runs like `cfg`, if it has them, and the line's words; else None.

        A run on a slot takes one without a build."""
        from tinker_exp.runtime.inputs import model_dir

        kept = self.kept.find(group_key(cfg, model_dir(cfg.model), self.choice(cfg), worker_env))
        if kept is None or kept.slot_group is None:
            return None
        self.kept.use(kept)
        self.runs += 1
        return kept.slot_group, kept_words(kept)

    def describe(self) -> list[dict[str, Any]]:
        """Each kept group, the most recently used first (`pool status`)."""
        return [
            {"group": describe_key(kept.key), "built_at": kept.built_at, "last_used": kept.last_used, "runs": kept.runs,
             "pids": list(kept.pids), "size_mb": kept.size_mb}  # fmt: skip
            for kept in reversed(self.kept.groups.values())
        ]

    def close(self) -> None:
        """The pool's Ray cluster stopped, and with it the groups (no actor freed one by one: they end with it)."""
        for kept in self.kept.groups.values():
            if kept.workers.output is not None:
                kept.workers.output.stop()
        self.stop_cluster()

    def stop_cluster(self) -> None:
        import ray

        self.kept.forget_all()
        self.cluster_env = None
        ray.shutdown()


def start_own_cluster(device: str, groups: int) -> None:
    """The pool's own local Ray cluster, started once.

    Never a run's RAY_ADDRESS, whose resources the pool's groups would then hold between runs. On a CPU machine it
    counts `groups` times its cores, so that that many kept groups (idle but for the one that trains) each hold a CPU a
    worker, as a cold run's do."""
    import os

    import ray

    from tinker_exp.runtime.ray_cluster import start_ray
    from tinker_exp.runtime.workers import platform_env

    if not ray.is_initialized():
        start_ray(None, platform_env(device), num_cpus=(os.cpu_count() or 1) * groups if device == "cpu" else None)


def cluster_capacity(device: str) -> float:
    """How many workers the pool's Ray cluster holds at once: its GPUs on a GPU machine, else its CPUs."""
    import ray

    resources = ray.cluster_resources()
    return float(resources.get("GPU" if device == "cuda" else "CPU", 0))


def is_dead_worker(error: BaseException) -> bool:
    """Ray's word for an actor that died (killed, crashed, out of memory)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(error, (ActorDiedError, ActorUnavailableError, RayActorError))


class SlotGroups:
    """The slot groups of one process (a sweep's trials on slots): one group at a time, K slots.

    Keyed as the pool keys its groups (runtime/warm.py `group_key`: what the workers are built with, less what a trial
    sets: its optimizer values, seed, steps, clip). A trial takes a free slot of its key's group (`take`); the group is
    built at the first trial of its key, and a trial of another key waits until the group holds no trial, which is then
    freed and the new key's built. `close` frees the group."""

    def __init__(self, capacity: int, build: Callable[..., Any], out_dir: Path, speaking_for: Callable[[int], Any] | None = None,
                 keep_saved: bool = False):  # fmt: skip
        """The process's slot groups, each built by `build`.

        `build`: a cold run's worker group (config, plan, model dir, out dir, device choice); `out_dir`: where what the
        workers print goes (its workers.log); `speaking_for(thread id)`: a context in which the build's thread logs and
        prints as the trial's thread that asked for it (the build's lines are its trial's); `keep_saved`: each slot
        keeps its state at its last checkpoint (SlotGroup's: a population's members)."""
        from concurrent.futures import ThreadPoolExecutor

        self.capacity, self.build, self.out_dir, self.speaking_for = capacity, build, out_dir, speaking_for
        self.keep_saved = keep_saved
        # Groups are built in one thread that lives as long as this holder: the Ray cluster a build starts has its
        # daemons die with the thread that started them (PR_SET_PDEATHSIG), and a trial's thread ends with its trial.
        self.builder = ThreadPoolExecutor(1, thread_name_prefix="slot-group-build")
        self.changed = threading.Condition()
        self.group: SlotGroup | None = None
        self.key: dict[str, Any] | None = None
        self.building = False
        self.closed = False

    def take(self, cfg: Any, plan: Any, model_path: Path, choice: Any, stop: threading.Event) -> tuple["Slot", str]:
        """A slot for a trial like `cfg`, with the one line that says where it trains.

        Waits while the group is full, being built, or of another key in use. `stop` set meanwhile: KeyboardInterrupt
        (the trial cancelled)."""
        key = slot_group_key(cfg, model_path, choice)
        with self.changed:
            while True:
                if stop.is_set() or self.closed:
                    raise KeyboardInterrupt
                group = self.group
                if not self.building and group is not None and self.key == key and len(group.slots) < self.capacity:
                    slot = group.fill(cfg.optimizer, cfg.trainer, plan.optimizer_values, stop=stop)
                    return slot, self._line(slot, "built for an earlier trial")
                if not self.building and (group is None or not group.slots):
                    self.group, self.key, self.building = None, None, True
                    break
                self.changed.wait(timeout=1.0)
        try:
            if group is not None:
                group.shutdown()
            built = self.builder.submit(self._built, threading.get_ident(), cfg, plan, model_path, choice).result()
        except BaseException:
            with self.changed:
                self.building = False
                self.changed.notify_all()
            raise
        with self.changed:
            self.building = False
            self.changed.notify_all()
            closed = self.closed
            if not closed:
                self.group, self.key = built, key
                slot = built.fill(cfg.optimizer, cfg.trainer, plan.optimizer_values, stop=stop)
        if closed:  # closed while it was built (Ctrl-C): nobody else frees it
            built.shutdown()
            raise KeyboardInterrupt
        return slot, self._line(slot, f"built for this trial: {describe_key(key)}")

    def _built(self, trial_thread: int, cfg: Any, plan: Any, model_path: Path, choice: Any) -> SlotGroup:
        from contextlib import nullcontext

        with self.speaking_for(trial_thread) if self.speaking_for else nullcontext():
            workers = self.build(cfg, plan, model_path, self.out_dir, choice)
            workers.ready()
            return SlotGroup(workers, self.capacity, on_free=self._freed, keep_saved=self.keep_saved)

    def _line(self, slot: "Slot", group: str) -> str:
        return f"slot {slot.index + 1} of {self.capacity} on this process's group, {group}"

    def _freed(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def close(self) -> None:
        """The group freed (its trials have ended or been stopped); a waiting trial is cancelled."""
        with self.changed:
            self.closed = True
            group, self.group = self.group, None
            self.changed.notify_all()
        if group is not None:
            group.shutdown()
        self.builder.shutdown()
