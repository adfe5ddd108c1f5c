"""The typed config: every default and its meaning live here, once; ``conf/`` YAML files hold only what differs.

Registered with Hydra's ConfigStore (``register``), so a wrong type fails at compose time. Each group checks its
own ranges in ``__post_init__`` (run by ``OmegaConf.to_object``); checks across groups live in
``tinker_exp.config.validate``. Pure Python (stdlib, omegaconf, hydra).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional, Tuple

from tinker_exp.config.rl import EnvConfig, LossConfig, RLConfig
from tinker_exp.errors import ConfigError

SCHEMA_NAME = "tinker_exp_schema"
"""The name conf/config.yaml lists first in its defaults."""


def _at_least(minimum: float, **values: Any) -> None:
    for key, value in values.items():
        if value < minimum:
            raise ConfigError(f"{key}: must be >= {minimum}, got {value!r}")


class Device(str, Enum):
    auto = "auto"  # cuda when torch sees a GPU, else cpu
    cpu = "cpu"
    cuda = "cuda"


class Precision(str, Enum):
    auto = "auto"  # bf16 on cuda, fp32 on cpu (bf16 autocast on CPU is slow and inexact)
    fp32 = "fp32"
    bf16 = "bf16"


class Attention(str, Enum):
    auto = "auto"  # flash_attention_2 when it can run (bf16 on a GPU that has it, flash-attn importable), else sdpa
    sdpa = "sdpa"
    flash_attention_2 = "flash_attention_2"
    eager = "eager"


class OptimizerKernel(str, Enum):
    auto = "auto"  # cuda: fused where torch has it (adam, adamw, sgd); cpu: foreach where it is exact (CPU_FOREACH_EXACT)
    fused = "fused"
    foreach = "foreach"
    for_loop = "for_loop"


FUSED_OPTIMIZERS = ("Adam", "AdamW", "SGD")
"""optimizer.name values whose torch class has a fused kernel (fused=True), on CUDA and CPU."""
CPU_FOREACH_EXACT = ("AdamW", "Adam", "SGD", "RMSprop", "Adagrad", "Adamax")
"""optimizer.name values whose foreach kernel steps bitwise as their for loop on CPU workers (FSDP2's DTensors;
tests/test_optimizers_ray.py): backend.optimizer_kernel=auto takes foreach for them on cpu. NAdam and RAdam's foreach
kernels round differently (1e-7), an optimizer not named here is new to the check: both keep their default."""
AUTO_MICRO_BATCH_TOKENS = 16384
"""backend.micro_batch_tokens=null on cuda: at most this many tokens a micro batch."""


class WandbMode(str, Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


class OptimizerName(str, Enum):
    """The optimizers of tinker_exp.optim.optimizers.OPTIMIZERS (a test holds the two lists equal)."""

    AdamW = "AdamW"
    Adam = "Adam"
    SGD = "SGD"
    RMSprop = "RMSprop"
    Adagrad = "Adagrad"
    NAdam = "NAdam"
    RAdam = "RAdam"
    Adamax = "Adamax"
    Muon = "Muon"  # Muon on the blocks' 2-D weight matrices, AdamW on the rest (tinker_exp.runtime.muon)
    AdamWScheduleFree = "AdamWScheduleFree"  # schedule-free AdamW (tinker_exp.runtime.schedule_free)


class ObjectiveMode(str, Enum):
    last = "last"
    min = "min"
    max = "max"  # higher is better: early stop and keep_best follow it (last on a reward is maximised too)


class DataFormat(str, Enum):
    auto = "auto"  # per file: messages rows if its first row has data.messages_key, else prompt/response rows
    prompt_response = "prompt_response"  # prompt + "\n" + response, bos/eos added; loss on the response and eos
    messages = "messages"  # a conversation rendered by the tokenizer's chat template; loss on the assistant turns


class Truncation(str, Enum):
    right = "right"  # keep the first data.max_length tokens
    left = "left"  # keep the last data.max_length tokens
    drop = "drop"  # drop the row
    error = "error"  # stop before any worker starts, naming the row


class ResumeMode(str, Enum):
    auto = "auto"  # continue from the newest usable checkpoint in the run dir, if it has one
    must = "must"  # the same, but fail when there is none
    never = "never"  # start at step 0; fail if the run dir already has checkpoints (nothing is overwritten)


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """A local Hugging Face causal-LM dir (config, weights, tokenizer) or a hub id (org/name, or a top-level name
    such as gpt2) from the local cache (downloaded before any worker starts when the hub can be reached). None: the
    tiny model below, built offline."""
    name: str = "tiny-llama"
    """Name of the built model (its cache folder's prefix)."""
    vocab_size: int = 384
    """Tiny model: size of the byte-level BPE vocabulary (trained on the shipped data sets, ChatML tokens included)."""
    hidden_size: int = 64
    """Tiny model: width."""
    intermediate_size: int = 128
    """Tiny model: MLP width."""
    num_layers: int = 2
    """Tiny model: decoder layers."""
    num_heads: int = 4
    """Tiny model: attention heads."""
    max_position_embeddings: int = 256
    """Tiny model: longest sequence."""
    init_seed: int = 0
    """Tiny model: seed of its random initialisation."""
    cache_dir: str = "${oc.env:TINKER_EXP_CACHE,'~/.cache/tinker_exp'}"
    """Where built models are cached."""

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "max_position_embeddings")
        _at_least(1, **{f"model.{key}": getattr(self, key) for key in sizes})


def _module_names(key: str, value: Any, allow_none: bool) -> None:
    """peft's forms: one string (a preset such as "all-linear", or a regex) or a non-empty list of names."""
    if value is None and allow_none:
        return
    names = value if isinstance(value, list) else [value]
    if not names or not all(isinstance(name, str) and name for name in names):
        wanted = "a module name, a regex or a non-empty list of names" + (" (or null)" if allow_none else "")
        raise ConfigError(f"{key}: expected {wanted}, got {value!r}")


@dataclass
class LoraConfig:
    """LoRA adapters (peft, through verl's HFModelConfig). rank 0 trains every weight (full fine-tuning)."""

    rank: int = 0
    """Adapter rank r; 0: no adapters, full fine-tuning. > 0: the base weights are frozen, only adapters train."""
    alpha: int = 16
    """Adapters' scale: each update is multiplied by alpha / rank (peft's lora_alpha; an integer in verl)."""
    target_modules: Any = "all-linear"
    """Modules that get adapters (peft's target_modules): "all-linear" (every linear layer but the output head),
    a list of module names (["q_proj", "v_proj"]) or a regex over module paths. Checked against the model
    before any worker starts."""
    exclude_modules: Any = None
    """Modules left without adapters (peft's exclude_modules): a list of names or a regex; None: none."""

    def __post_init__(self) -> None:
        _at_least(0, **{"lora.rank": self.rank})
        _at_least(1, **{"lora.alpha": self.alpha})
        _module_names("lora.target_modules", self.target_modules, allow_none=False)
        _module_names("lora.exclude_modules", self.exclude_modules, allow_none=True)


@dataclass
class DataConfig:
    path: str = "builtin:tiny_sft.jsonl"
    """A JSONL file (a Parquet file when it ends in .parquet or .pq) of prompt/response or messages rows;
    "builtin:NAME" is a file shipped in tinker_exp/assets."""
    format: DataFormat = DataFormat.auto
    """Row format of every data file; auto: detected per file from its first row (its columns, for Parquet)."""
    prompt_key: str = "prompt"
    """prompt_response rows: the prompt's field."""
    response_key: str = "response"
    """prompt_response rows: the response's field (the loss is on its tokens only)."""
    messages_key: str = "messages"
    """messages rows: the field holding the conversation, a list of {role: system|user|assistant, content: str}
    with at least one assistant turn (the loss is on every assistant turn's tokens, its end-of-turn token included)."""
    max_length: int = 128
    """Tokens per example; what happens to longer rows: truncation."""
    truncation: Truncation = Truncation.right
    """Rows longer than max_length: cut (right: keep the start; left: keep the end), drop, or error. A row left
    with no trained token is dropped."""
    shuffle: bool = True
    """Shuffle each epoch (seeded by trainer.seed and the epoch: a resumed run sees the same order)."""
    val_path: Optional[str] = None
    """Validation rows (JSONL or Parquet, either format). None: hold out val_fraction of the training file."""
    val_fraction: Optional[float] = 0.1
    """Without val_path: this share of the training file's rows is held out for validation (None: no validation)."""
    split_seed: int = 0
    """Seed of the held-out split (not trainer.seed: a sweep over training seeds keeps one validation set)."""

    def __post_init__(self) -> None:
        _at_least(1, **{"data.max_length": self.max_length})
        if self.val_fraction is not None and not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction: {self.val_fraction!r} is not in (0, 1) (null: no validation)")


@dataclass
class OptimizerConfig:
    """The worker's optimizer.

    Its float values are converted (float, tuple) and range-checked by the same converter as overrides
    (tinker_exp.optim.convert), so its param groups hold exactly those types. Each optimizer is built with the fields
    its entry in tinker_exp.optim.optimizers.OPTIMIZERS lists (built_with); the others are unused."""

    name: OptimizerName = OptimizerName.AdamW
    """The optimizer verl builds: a torch.optim class, Muon (Muon + AdamW) or AdamWScheduleFree."""
    lr: float = 1e-3
    """Learning rate the optimizer is built with (an override replaces it per step). Muon: both sub-optimizers'."""
    betas: Tuple[float, float] = (0.9, 0.999)
    """Adam family (AdamW, Adam, NAdam, RAdam, Adamax; Muon's AdamW part): betas."""
    eps: float = 1e-8
    """Adam family and RMSprop, Adagrad: the denominator's epsilon (Muon's AdamW part too)."""
    weight_decay: float = 0.01
    """Weight decay (decoupled for AdamW and Muon; L2 in the gradient for the others)."""
    momentum: float = 0.0
    """SGD, RMSprop: momentum factor."""
    dampening: float = 0.0
    """SGD: dampening of the momentum."""
    nesterov: bool = False
    """SGD: Nesterov momentum (needs momentum > 0 and dampening 0)."""
    alpha: float = 0.99
    """RMSprop: smoothing constant of the squared-gradient average."""
    centered: bool = False
    """RMSprop: normalise by the gradient's estimated variance."""
    lr_decay: float = 0.0
    """Adagrad: learning-rate decay."""
    initial_accumulator_value: float = 0.0
    """Adagrad: starting value of the squared-gradient sums."""
    momentum_decay: float = 4e-3
    """NAdam: momentum decay (psi)."""
    decoupled_weight_decay: bool = False
    """NAdam, RAdam: decoupled weight decay (AdamW-style) instead of L2."""
    muon_momentum: float = 0.95
    """Muon: momentum of its matrices' part."""
    muon_nesterov: bool = True
    """Muon: Nesterov momentum."""
    muon_eps: float = 1e-7
    """Muon: the Newton-Schulz iteration's eps (not Adam's)."""
    ns_steps: int = 5
    """Muon: Newton-Schulz iterations per step."""
    adjust_lr_fn: str = "match_rms_adamw"
    """Muon: how its update is scaled; match_rms_adamw (Moonlight) gives it AdamW's RMS, so one lr serves both
    parts; "original" is Keller Jordan's scaling (then lr means something else for the two parts)."""
    warmup_steps: int = 0
    """AdamWScheduleFree: its own linear warmup, in steps (a step k uses lr * min(1, (k+1)/warmup_steps)); sent per
    step as the override key warmup_steps. Not the lr override's warmup (override.lr.warmup_steps)."""
    r: float = 0.0
    """AdamWScheduleFree: the averaged weights' polynomial weighting power (step k weighs (k+1)^r)."""
    weight_lr_power: float = 2.0
    """AdamWScheduleFree: each step's weight in the average also scales as the largest lr so far to this power."""
    clip_grad: Optional[float] = 1.0
    """Gradient-norm clip: the total grad norm is scaled down to at most this (the engine's, from its build on; an
    override's grad_clip_norm replaces it step by step). 0 or null: no clipping, as Tinker's grad_clip_norm=0 and
    HF's max_grad_norm=0."""

    @property
    def max_grad_norm(self) -> float:
        """The max_norm verl's engine clips with: clip_grad, or inf for no clipping.

        verl always clips, and a max_norm of 0 would zero every gradient; inf scales them by 1 and still reports the
        norm."""
        return float(self.clip_grad) if self.clip_grad else math.inf

    def __post_init__(self) -> None:
        if self.clip_grad is not None:
            _at_least(0, **{"optimizer.clip_grad": self.clip_grad})
        _at_least(1, **{"optimizer.ns_steps": self.ns_steps})
        if self.name == OptimizerName.SGD and self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError(
                f"optimizer.nesterov: true needs momentum > 0 and dampening 0 (got momentum={self.momentum}, "
                f"dampening={self.dampening})"
            )
        if self.adjust_lr_fn not in ("match_rms_adamw", "original"):
            raise ConfigError(f"optimizer.adjust_lr_fn: {self.adjust_lr_fn!r} is not match_rms_adamw or original")


@dataclass
class BackendConfig:
    strategy: str = "fsdp2"
    """verl engine strategy."""
    num_workers: int = 2
    """Workers (GPUs) per node."""
    nodes: int = 1
    """Ray nodes the workers span; >1 joins a multi-node Ray cluster (launchers/slurm_multinode.sbatch)."""
    nodes_timeout_s: float = 300.0
    """How long to wait for that many Ray nodes to join."""
    device: Device = Device.auto
    """auto: CUDA GPUs (nccl, bf16) when torch sees one, else CPU gloo workers (fp32)."""
    micro_batch_size: int = 2
    """Sequences per worker per forward pass; the rest of a worker's batch is gradient accumulation."""
    precision: Precision = Precision.auto
    """auto: bf16 on cuda, fp32 on cpu."""
    ray_address: Optional[str] = "${oc.env:RAY_ADDRESS,null}"
    """A Ray cluster to join; None: start a local one (and stop it at the end)."""
    pool: str = "${oc.env:TINKER_EXP_POOL,auto}"
    """Warm workers (docs/pool.md): auto: a free pool of this sweep's, else this user's (`python -m tinker_exp.pool
    up`) if one is up, else a cold start; none: always a cold start; else a pool's address (its socket). The
    environment's TINKER_EXP_POOL sets the default (a job script's `export TINKER_EXP_POOL=none`)."""
    # --- throughput (docs/devices.md#throughput-knobs); each default leaves a CPU run's losses as they were ---
    micro_batch_tokens: Optional[int] = None
    """Micro batches by tokens (verl's use_dynamic_bsz, max_token_len_per_gpu): each worker's sequences are packed
    into balanced micro batches of at most this many tokens (>= data.max_length) instead of micro_batch_size
    sequences each. 0: by sequences (micro_batch_size). None: 16384 on cuda, by sequences on cpu. SFT and
    validation; RL runs stay by sequences."""
    padding_free: Optional[bool] = None
    """verl's use_remove_padding: a micro batch's sequences are concatenated into one row without pad tokens
    (attention kept within each sequence); false pads every sequence to the micro batch's longest. None: on for
    cpu and for flash_attention_2 (its variable-length kernel), off for sdpa on cuda (transformers then masks the
    packed row with a full tokens x tokens mask, which keeps SDPA off its flash kernel). SFT and validation (RL
    runs pad)."""
    attention: Attention = Attention.auto
    """auto: flash_attention_2 for bf16 on a GPU with bf16 when flash-attn imports against this torch, else sdpa
    (flash-attn has no fp32 kernels); flash_attention_2 where it cannot run is refused before any worker starts."""
    gradient_checkpointing: bool = False
    """Activation checkpointing (recompute each layer's activations in the backward): less memory, ~1/3 more
    compute. verl's default is on; ours is off (throughput): turn it on when a micro batch does not fit."""
    torch_compile: Optional[bool] = None
    """verl's use_torch_compile. None: on for cuda, off for cpu. verl 0.9.1 compiles only its entropy function,
    which the SFT and RL losses here do not compute: no effect on a step's time today."""
    fused_lm_head: Optional[bool] = None
    """verl's fused lm head (use_fused_kernels, its torch backend): the log-probs computed 512 tokens at a time
    from the last hidden states, never the whole logits tensor. Without it, and without flash-attn's cross-entropy,
    verl 0.9.1 computes a padding-free batch's log-probs one token at a time in a Python loop. None: on for cuda,
    off for cpu (the same values up to float rounding)."""
    reshard_after_forward: Optional[bool] = None
    """FSDP2's reshard_after_forward: true frees each layer's gathered parameters after its forward and gathers
    them again for its backward (less memory: verl's default); false keeps them to the backward (one all-gather
    fewer per layer and micro batch; the workers reshard after a forward-only evaluation). Moves data only: losses
    are bitwise the same. None: false on cpu (faster), true on cuda (memory). SFT runs (RL's actor keeps verl's
    default)."""
    liger: Optional[bool] = None
    """Liger's fused Triton kernels (RMSNorm, SwiGLU, RoPE) patched into the model by verl (use_liger; its fused
    cross-entropy stays off, as verl sets it). None: on for cuda when liger_kernel imports, off on cpu (Triton is
    for GPUs); true where it cannot run is refused before any worker starts. SFT runs."""
    optimizer_kernel: OptimizerKernel = OptimizerKernel.auto
    """The torch optimizer's implementation: fused (one kernel for all parameters; adam, adamw, sgd), foreach
    (batched per op; every torch optimizer, not muon), for_loop (per parameter). auto: on cuda fused where the
    optimizer has it, else torch's own default (foreach); on cpu foreach where it steps bitwise as the for loop
    (CPU_FOREACH_EXACT), else the for loop."""

    def __post_init__(self) -> None:
        if min(self.num_workers, self.nodes, self.micro_batch_size) < 1:
            raise ConfigError(
                f"backend.num_workers={self.num_workers}, backend.nodes={self.nodes} and "
                f"backend.micro_batch_size={self.micro_batch_size} must be >= 1"
            )
        if self.nodes_timeout_s <= 0:
            raise ConfigError(f"backend.nodes_timeout_s: must be > 0, got {self.nodes_timeout_s!r}")
        if self.pool not in ("auto", "none") and not self.pool.startswith("${") and "/" not in self.pool and not self.pool.endswith(".sock"):
            meant = f"; did you mean {self.pool.lower()}?" if self.pool.lower() in ("auto", "none") else ""
            raise ConfigError(f"backend.pool={self.pool}: not one of auto, none or a pool's socket path (a path with a "
                              f"'/' or ending in .sock){meant}")  # fmt: skip
        if self.pool not in ("auto", "none") and self.nodes > 1:
            raise ConfigError(f"backend.pool={self.pool}: a pool holds workers on its own machine; a run over backend.nodes={self.nodes} starts cold (backend.pool=auto or none)")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 0:
            raise ConfigError(
                f"backend.micro_batch_tokens: must be >= 0 (0: by sequences) or null (auto), got {self.micro_batch_tokens!r}"
            )

    def tokens_per_micro_batch(self, device: str) -> int:
        """The token budget of a micro batch on `device` (cpu, cuda); 0: by sequences."""
        if self.micro_batch_tokens is None:
            return AUTO_MICRO_BATCH_TOKENS if device == "cuda" else 0
        return self.micro_batch_tokens


@dataclass
class LoggerConfig:
    """Where a run's metrics go besides metrics.jsonl (always written), and W&B's settings.

    Each option of the logger group (conf/logger/) sets its own flag, so a list of options composes to all of them:
    `logger=[wandb,csv]` sets wandb and csv; `logger=none` none."""

    wandb: bool = False
    """W&B (logger=wandb, the default: conf/config.yaml), offline unless mode=online."""
    csv: bool = False
    """metrics.csv in the run dir (logger=csv): metrics.jsonl's rows as a table."""
    tensorboard: bool = False
    """Event files in the run dir's tensorboard/ (logger=tensorboard)."""
    project: str = "tinker_exp"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (team or user); None: the API key's default."""
    mode: WandbMode = WandbMode.offline
    """offline by default; online needs WANDB_API_KEY in the environment (never in a config)."""
    group: Optional[str] = None
    """None: a sweep's jobs share one group (the sweep dir), a single run has none."""
    run_name: Optional[str] = None
    """None: a sweep job's overrides, else the run dir's name."""
    tags: list = field(default_factory=list)
    """W&B tags."""
    init_timeout_s: float = 30.0
    """How long W&B may take to start before the run goes on without it."""

    @property
    def names(self) -> list[str]:
        """The loggers this run writes to besides metrics.jsonl, as the logger group names them."""
        return [name for name in ("wandb", "csv", "tensorboard") if getattr(self, name)]


@dataclass
class EarlyStopConfig:
    patience: int = 0
    """Evaluations in a row without an improvement of at least min_delta in the objective metric (lower is
    better) after which the run ends, with a checkpoint at that step; 0: never stop early."""
    min_delta: float = 0.0
    """The least decrease of the objective metric that counts as an improvement."""

    def __post_init__(self) -> None:
        _at_least(0, **{"trainer.early_stop.patience": self.patience, "trainer.early_stop.min_delta": self.min_delta})


@dataclass
class TrainerConfig:
    steps: int = 20
    """Optimizer steps of the run."""
    batch_size: int = 8
    """Sequences per optimizer step, over all workers."""
    seed: int = 0
    """Seed of the data order and the workers."""
    max_nonfinite_steps: int = 0
    """Steps with a non-finite loss or grad norm that are tolerated (verl skips their update); one more stops
    the run (exit 4), keeping the last checkpoint saved before it."""
    eval_every: int = 10
    """Evaluate on the validation set after every N steps (0: only after the last step), when there is one."""
    objective: Optional[str] = None
    """The metric the run returns to Hydra's sweeper. None: val/loss, or train/loss without validation data; an RL
    run's eval/reward, or train/reward without held-out prompts."""
    objective_mode: ObjectiveMode = ObjectiveMode.last
    """last: the metric's last logged value (lower is better, but higher for a reward: train/reward, eval/reward);
    min: its lowest (lower is better); max: its highest (higher is better). Early stop, keep_best, a study's
    direction and a population's ranking follow it."""
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    """End the run early when the objective metric stops improving at evaluations."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"trainer.steps: must be >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise ConfigError(f"trainer.batch_size: must be >= 1, got {self.batch_size}")
        if self.max_nonfinite_steps < 0:
            raise ConfigError(f"trainer.max_nonfinite_steps={self.max_nonfinite_steps} must be >= 0")
        _at_least(0, **{"trainer.eval_every": self.eval_every})


@dataclass
class CheckpointConfig:
    every_steps: int = 10
    """Save after every N steps (0: never periodically)."""
    at_end: bool = True
    """Save after the last step."""
    keep_last: int = 2
    """Complete checkpoints kept (0: all)."""
    dir: str = "checkpoints"
    """Inside the run dir."""
    sha256: bool = False
    """Hash every file on save and check on load (sizes are always checked)."""
    keep_every: int = 0
    """Also keep, outside the keep_last rotation, every checkpoint whose step is a multiple of N (branch points;
    0: none)."""
    keep_best: bool = False
    """Also keep, outside the rotation, the checkpoint with the lowest objective metric among those saved at an
    evaluation step (named in checkpoints/BEST.json and objective.json)."""

    def __post_init__(self) -> None:
        for key in ("every_steps", "keep_last", "keep_every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"checkpoint.{key}={getattr(self, key)} must be >= 0")


BRANCH_KEYS = ("from", "step")


@dataclass
class BranchConfig:
    """Start a new run from another run's checkpoint (`branch.from=<run dir> branch.step=N`).

    Built from the `branch` node by ``Config.__post_init__``: `from` is a Python keyword, so the node is a plain
    mapping."""

    source: Optional[str] = None
    """`branch.from`: the trunk's run dir (a run's or a sweep job's); None: not a branch."""
    step: Optional[int] = None
    """`branch.step`: the trunk's checkpoint to start from (a step it has one for); None: its newest usable one."""

    @classmethod
    def of(cls, node: Any) -> "BranchConfig":
        if isinstance(node, BranchConfig):
            return node
        node = dict(node or {})
        for key in node:
            if key not in BRANCH_KEYS:
                raise ConfigError(f"branch.{key}: not a key of branch (its keys: {', '.join(BRANCH_KEYS)})")
        source, step = node.get("from"), node.get("step")
        if source is not None and (not isinstance(source, str) or not source):
            raise ConfigError(f"branch.from: expected a run dir, got {source!r}")
        if step is not None and (type(step) is not int or step < 0):
            raise ConfigError(f"branch.step: expected a step >= 0 (an integer), got {step!r}")
        if step is not None and source is None:
            raise ConfigError(f"branch.step={step} needs branch.from=<run dir> (the run to branch from)")
        return cls(source, step)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    """RL: prompts and a reward (env=NAME from conf/env/, or env.prompts + env.reward); none: supervised
    fine-tuning on the data set."""
    rl: RLConfig = field(default_factory=RLConfig)
    """RL: group size, prompts per step, temperature, advantage, KL penalty (used only with an env)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The loss: cross_entropy (SFT) or an RL loss (loss=NAME from conf/loss/)."""
    resume: ResumeMode = ResumeMode.auto
    """Re-running in the same run dir continues from its newest checkpoint (auto), must (must) or must not (never)."""
    branch: Any = field(default_factory=lambda: {"from": None, "step": None})
    """`branch.from=<run dir>` (and `branch.step=N`): a new run starting from another run's checkpoint with this
    config's plan, steps, evaluation and data (tinker_exp.train.start). Read as a BranchConfig."""
    override: Any = None
    """Values sent with every optimizer_step (lr, betas, eps, weight_decay; constants or schedules); None: nothing
    is sent. Selected with +override=NAME or +override.KEY=VALUE; untyped so YAML ints and lists reach the
    converter as they are."""
    dry_run: bool = False
    """Compose and validate everything, write and print the plan, start nothing."""
    plan_steps: List[int] = field(default_factory=list)
    """Steps whose values the plan's table shows too (printed at the start, in plan.json and W&B), besides the first
    steps, each phase boundary and the last: `plan_steps=[100,99999] dry_run=true`."""
    verbose: bool = False
    """Show what the workers and libraries say on the terminal too (it always goes to the run dir's workers.log)."""

    def __post_init__(self) -> None:
        self.branch = BranchConfig.of(self.branch)


def _add(*values: Any) -> int:
    """`${add:a,b}`: a sum of integers (a decay branch's trainer.steps: its branch.step plus the decay's length)."""
    if not all(type(value) is int for value in values):
        raise ConfigError(f"add: expected integers, got {list(values)!r}")
    return sum(values)


def register() -> None:
    """Store the schema in Hydra's ConfigStore and our resolvers in OmegaConf (before composing; idempotent)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    if f"{SCHEMA_NAME}.yaml" not in store.repo:  # once a process (building it from the dataclasses is not free)
        store.store(name=SCHEMA_NAME, node=Config)
    OmegaConf.register_new_resolver("add", _add, replace=True)
