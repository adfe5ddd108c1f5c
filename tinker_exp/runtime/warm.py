"""A worker group kept warm across runs (the pool's: tinker_exp/pool/): built once per key, then every run it is
lent to starts from exactly the state a cold build of its command leaves (runtime/workers.py `fresh_engine`).

What needs a new group is what the workers are built with, less what a run sends: its optimizer values and seed
(`group_key`): the config's worker settings, the model's files as they are now, and the environment that reaches
the workers. A run whose key differs frees the group and builds one for its own (on a new Ray cluster when the
workers' environment differs: Ray's processes keep the one they started with); a group whose workers died is built
again; each said in one line.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable

from tinker_exp.config import Config
from tinker_exp.runtime.worker_output import WorkerOutput
from tinker_exp.runtime.workers import TinkerWorkers

log = logging.getLogger(__name__)

BuildWorkers = Callable[[Config, Any, Path, Path, Any], TinkerWorkers]
"""(config, plan, model dir, run dir, device choice) -> the worker group, starting: a cold run's (assemble.verl_workers)."""


PER_RUN_BACKEND = ("pool", "nodes_timeout_s", "ray_address")
"""backend keys that do not shape the workers (the group's Ray cluster is the pool's)."""


def group_key(cfg: Config, model_path: Path, choice: Any, worker_env: dict[str, str]) -> dict[str, Any]:
    """What the workers of a run like `cfg` are built with (runtime/workers.py `worker_config`), less what a fresh
    state sets per run (optimizer values, seed, steps, gradient clip): two runs with the same key share a group.
    `worker_env`: the run's environment that reaches the workers (pool/wire.py `worker_environment`)."""
    backend = {k: v for k, v in dataclasses.asdict(cfg.backend).items() if k not in PER_RUN_BACKEND}
    rl = cfg.rl
    return {
        "worker": "TinkerActorRolloutRefWorker" if cfg.env.active else "TinkerTrainingWorker",
        "model": str(model_path),
        "model_files": model_fingerprint(model_path),
        "worker_env": dict(worker_env),
        "device": choice.describe(),
        "backend": {k: getattr(v, "value", v) for k, v in backend.items()},
        "lora": dataclasses.asdict(cfg.lora) if cfg.lora.rank > 0 else None,
        "optimizer": cfg.optimizer.name.value,
        "rl_batch": (rl.prompts_per_step, rl.group_size) if cfg.env.active else None,
    }


def model_fingerprint(model_path: Path) -> str:
    """The model dir's files as they are now (each file's name, size and change time; cheap, no read): weights
    replaced at the same path are not the ones the kept workers loaded."""
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
    """The group as one run sees it: the worker group's calls, but `shutdown` gives it back instead of freeing it."""

    def __init__(self, workers: TinkerWorkers) -> None:
        self._workers = workers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._workers, name)

    def ready(self) -> None:
        log.info(f"workers: {self._workers.placement} (warm: the pool's, from the start a cold build leaves)")

    def shutdown(self) -> None:
        if self._workers.output is not None:
            self._workers.output.stop()


class WarmGroup:
    """The pool's worker group: built at the first run (or `prepare`), lent to one run at a time."""

    def __init__(self, build: BuildWorkers, workers_log: str) -> None:
        """`build`: a cold run's worker group; `workers_log`: the file in a run dir that gets what the workers print."""
        self.build, self.workers_log = build, workers_log
        self.workers: TinkerWorkers | None = None
        self.key: dict[str, Any] | None = None
        self.built_at: float | None = None
        self.pids: list[int] = []
        """Each rank's process (the pool's status shows their memory)."""
        self.runs = 0
        self.worker_env: dict[str, str] = {}
        """The environment of the run being served that reaches the workers (set by the pool for each run)."""
        self.cluster_env: dict[str, str] | None = None
        """The worker environment the pool's Ray cluster was started with (None: no cluster yet)."""

    def lend(self, cfg: Config, plan: Any, model_path: Path, run_dir: Path) -> Lent:
        """The group for this run, in the state a cold start of it leaves: the kept one when its key matches, else a
        new one (the old freed first); what the workers print goes to the run dir from now on."""
        output = WorkerOutput(run_dir / self.workers_log, echo=cfg.verbose)

        def start_fresh() -> None:
            workers = self.prepare(cfg, plan, model_path, run_dir)
            workers.for_run(cfg)  # an RL run's own loss, not the first run's
            workers.start_fresh(cfg.optimizer, cfg.trainer, plan.optimizer_values, output)

        try:
            start_fresh()
        except Exception as e:
            if not is_dead_worker(e):
                raise
            log.info(f"pool: a worker had died ({type(e).__name__}); building the group again")
            self.free()
            start_fresh()
        self.runs += 1
        return Lent(self.workers)

    def prepare(self, cfg: Config, plan: Any, model_path: Path, out_dir: Path) -> TinkerWorkers:
        """The group for runs like `cfg`, built now (what it prints into `out_dir`) if the kept one's key differs or
        there is none."""
        from tinker_exp.runtime.device import resolve

        choice = resolve(cfg.backend)
        key = group_key(cfg, model_path, choice, self.worker_env)
        if self.workers is not None and key != self.key:
            log.info(f"pool: a new group for this run ({key_difference(self.key, key)}); the old one freed")
            self.free()
        if self.cluster_env is not None and self.cluster_env != key["worker_env"]:
            self.stop_cluster()  # Ray's processes keep the environment they started with: a new cluster for this one
        if self.workers is None:
            started = time.monotonic()
            start_own_cluster(choice.device)
            self.cluster_env = key["worker_env"]
            workers = self.build(cfg, plan, model_path, out_dir, choice)
            workers.owns_ray = False  # the pool's cluster outlives its groups: freeing one frees its actors only
            try:
                workers.ready()
                workers.keep_initial_state()
            except BaseException:
                workers.shutdown()
                raise
            self.workers, self.key, self.built_at = workers, key, time.time()
            self.pids = [info["pid"] for info in workers.group.device_info()]
            log.info(f"pool: group built in {time.monotonic() - started:.1f} s: {describe_key(key)}")
        return self.workers

    def free(self) -> None:
        if self.workers is not None:
            workers, self.workers, self.key, self.pids = self.workers, None, None, []
            workers.shutdown()

    def close(self) -> None:
        """The pool's Ray cluster stopped, and with it the group (no actor freed one by one: they end with it)."""
        if self.workers is not None and self.workers.output is not None:
            self.workers.output.stop()
        self.stop_cluster()

    def stop_cluster(self) -> None:
        import ray

        self.workers = self.key = self.cluster_env = None
        self.pids = []
        ray.shutdown()


def start_own_cluster(device: str) -> None:
    """The pool's own local Ray cluster, started once: never a run's RAY_ADDRESS, whose resources the pool's
    groups would then hold between runs."""
    import ray

    from tinker_exp.runtime.ray_cluster import start_ray
    from tinker_exp.runtime.workers import platform_env

    if not ray.is_initialized():
        start_ray(None, platform_env(device))


def is_dead_worker(error: BaseException) -> bool:
    """Ray's word for an actor that died (killed, crashed, out of memory)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(error, (ActorDiedError, ActorUnavailableError, RayActorError))
