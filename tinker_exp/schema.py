"""Typed config schema, registered with Hydra's ConfigStore: a wrong type fails at compose time.

Pure Python (stdlib, omegaconf, hydra).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Tuple

from hydra.core.config_store import ConfigStore


class Device(str, Enum):
    auto = "auto"  # cuda when torch sees a GPU, else cpu
    cpu = "cpu"
    cuda = "cuda"


class Precision(str, Enum):
    auto = "auto"  # bf16 on cuda, fp32 on cpu (bf16 autocast on CPU is slow and inexact)
    fp32 = "fp32"
    bf16 = "bf16"


class LoggerName(str, Enum):
    wandb = "wandb"
    none = "none"


class WandbMode(str, Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


class OptimizerName(str, Enum):
    AdamW = "AdamW"
    Adam = "Adam"


@dataclass
class ModelConfig:
    # A local HF model dir. None: build the tiny model below offline (once; cached in cache_dir).
    path: Optional[str] = None
    name: str = "tiny-llama"
    vocab_size: int = 384
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    max_position_embeddings: int = 256
    init_seed: int = 0
    cache_dir: str = "${oc.env:TINKER_EXP_CACHE,'~/.cache/tinker_exp'}"


@dataclass
class DataConfig:
    path: str = "builtin:tiny_sft.jsonl"  # "builtin:NAME" is a file shipped in tinker_exp/assets
    prompt_key: str = "prompt"
    response_key: str = "response"
    max_length: int = 128
    shuffle: bool = True


@dataclass
class OptimizerConfig:
    name: OptimizerName = OptimizerName.AdamW
    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad: float = 1.0


@dataclass
class BackendConfig:
    strategy: str = "fsdp2"
    num_workers: int = 2  # workers (GPUs) per node
    nodes: int = 1  # Ray nodes the workers span; >1 joins a multi-node Ray cluster (launchers/slurm_multinode.sbatch)
    nodes_timeout_s: float = 300.0  # how long to wait for that many Ray nodes to join
    device: Device = Device.auto
    micro_batch_size: int = 2  # sequences per worker per forward pass; the rest is gradient accumulation
    precision: Precision = Precision.auto
    ray_address: Optional[str] = "${oc.env:RAY_ADDRESS,null}"  # None: start a local Ray cluster


@dataclass
class LoggerConfig:
    name: LoggerName = LoggerName.wandb
    project: str = "tinker_exp"
    entity: Optional[str] = None
    mode: WandbMode = WandbMode.offline
    group: Optional[str] = None  # None: a sweep's jobs share one group (the sweep), a single run has none
    run_name: Optional[str] = None  # None: a sweep job's overrides, else the run dir's name
    tags: list = field(default_factory=list)
    init_timeout_s: float = 30.0


class ResumeMode(str, Enum):
    auto = "auto"  # continue from the newest usable checkpoint in the run dir, if it has one
    must = "must"  # the same, but fail when there is none
    never = "never"  # start at step 0; fail if the run dir already has checkpoints (nothing is overwritten)


@dataclass
class TrainerConfig:
    steps: int = 20
    batch_size: int = 8  # sequences per optimizer step, over all workers
    seed: int = 0
    # Steps with a non-finite loss or grad norm that are tolerated (verl skips their update); one more stops
    # the run (exit 4), keeping the last checkpoint saved before it.
    max_nonfinite_steps: int = 0


@dataclass
class CheckpointConfig:
    every_steps: int = 10  # save after every N steps (0: never periodically)
    at_end: bool = True  # save after the last step
    keep_last: int = 2  # complete checkpoints kept (0: all)
    dir: str = "checkpoints"  # inside the run dir
    sha256: bool = False  # hash every file on save and check on load (sizes are always checked)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resume: ResumeMode = ResumeMode.auto  # re-running in the same run dir continues from its checkpoint
    # Values sent with every optimizer_step (lr, betas, eps, weight_decay); None: nothing is sent.
    # Selected with +override=NAME or +override.KEY=VALUE; untyped so YAML ints/lists reach the converter.
    override: Any = None
    dry_run: bool = False  # compose and validate everything, print the plan, start nothing


def register_configs() -> None:
    ConfigStore.instance().store(name="tinker_exp_schema", node=Config)
