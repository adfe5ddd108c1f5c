"""Schemas stored in Hydra's ConfigStore: hydra/launcher=local, also as hydra/launcher=basic, and hydra/sweeper=basic.

hydra/launcher=local: submitit's local keys, ours on top; also stored as hydra/launcher=basic, the launcher `-m` uses
unless told otherwise (Hydra's own runs the jobs in this process, with no summary and no report). hydra/sweeper=basic,
the sweeper `-m` uses unless told otherwise, is our GridSweeper.

Why `basic` is replaced rather than a `grid` (or `local`) default picked: a default picked in conf/config.yaml's
defaults list would win over the `override /hydra/sweeper: optuna` (or a launcher) of an hparams_search preset (Hydra
applies the primary config's overrides last). Hydra scans its core plugins before hydra_plugins, so this entry is the
one it keeps.

In a module of its own, without `from __future__ import annotations`: Hydra's plugin scan imports these modules
outside sys.modules, where a dataclass cannot resolve string annotations.
"""

from dataclasses import dataclass
from typing import Any, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeperConf
from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf


@dataclass
class LocalLauncherConf(LocalQueueConf):
    _target_: str = "hydra_plugins.tinker_exp_plugins.launchers.LocalSweepLauncher"
    gpus_per_node: Optional[int] = 0
    max_parallel: Optional[int] = None
    """Points run at once (the rest start as earlier ones end); null: as many as the CPUs hold at one CPU a worker
    (tinker_exp.sweep.jobs.points_at_once)."""
    slots: Any = "auto"
    """LoRA trials trained at once on one loaded base model (docs/slots.md): K > 1 runs every job as a thread of the
    sweep's own process, each on a slot of one worker group it keeps (one group, built at the first job), K jobs
    at a time (and no more than max_parallel, when that is set); an Optuna study keeps K trials running whatever its
    n_jobs; every point must then train LoRA (lora.rank > 0), SFT, on one node. 1: a process a job, on a pool or
    cold. auto (default): slots where every trial can take one and the sweep does not vary their shape (LoRA, model,
    RL, nodes), as many as memory holds, at most 8 (tinker_exp/sweep/slot_count.py); else 1. Said in one line."""
    python: Optional[str] = "${oc.env:TINKER_EXP_JOB_PYTHON,null}"
    """The command that starts each job's Python (submitit's `python`, e.g. a wrapper that enters a container);
    null: this interpreter. Its default comes from TINKER_EXP_JOB_PYTHON when that is set."""


ConfigStore.instance().store(group="hydra/launcher", name="tinker_exp_local", node=LocalLauncherConf, provider="tinker_exp")
ConfigStore.instance().store(group="hydra/launcher", name="basic", node=LocalLauncherConf, provider="tinker_exp")


@dataclass
class SlurmLauncherConf(SlurmQueueConf):
    """submitit_slurm's keys (sbatch options), and ours."""

    _target_: str = "hydra_plugins.tinker_exp_plugins.launchers.SlurmSweepLauncher"
    workers: int = 0
    """An Optuna study's worker jobs: each starts its workers once (a warm pool in its allocation) and runs trials from
    the study's storage one after another until the study has its n_trials. 0 (default): one job per trial, each with
    one trial's time limit (a worker's timeout_min must hold its share of the trials). Grids and PBT: a job per point
    whatever this says."""
    slots: Any = "auto"
    """With study workers (workers > 0): LoRA trials each worker trains at once on slots of one group it builds in its
    allocation (docs/slots.md), each trial a thread of the worker's process (every trial must then train LoRA,
    SFT); 1: one trial after another on its pool; auto (default): as the local launcher's auto decides, from the
    worker node's memory. Without workers, a job per trial (auto is 1; an int > 1 is refused)."""


ConfigStore.instance().store(group="hydra/launcher", name="tinker_exp_slurm", node=SlurmLauncherConf, provider="tinker_exp")


@dataclass
class GridSweeperConf(BasicSweeperConf):
    """Hydra's basic sweeper's keys (max_batch_size, params): every combination of the swept values."""

    _target_: str = "hydra_plugins.tinker_exp_plugins.launchers.GridSweeper"
    share_prefixes: bool = True
    """On the local launcher: points whose plans are equal up to a step (and whose configs differ only in their plans
    and lengths) train those steps once: each continues from an earlier point's checkpoint there, its rows before it
    copied (docs/branching.md). false: each point trains alone."""


ConfigStore.instance().store(group="hydra/sweeper", name="basic", node=GridSweeperConf, provider="tinker_exp")
