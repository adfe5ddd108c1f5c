"""Checks across config groups (each group checks its own fields in its ``__post_init__``). Pure Python."""

from __future__ import annotations

import json
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tinker_exp.config.schema import Config
from tinker_exp.errors import ConfigError
from tinker_exp.formats import not_a_folder

ASSETS = Path(__file__).resolve().parent.parent / "assets"
"""Where "builtin:NAME" data files live (shipped in the package)."""


def data_path(path: str, key: str = "data.path") -> Path:
    """A data file, which must exist (`key` names it in errors).

    "builtin:NAME" is tinker_exp/assets/NAME; ~ is the home dir (as in model.path)."""
    resolved = ASSETS / path.removeprefix("builtin:") if path.startswith("builtin:") else Path(path).expanduser()
    if resolved.is_dir():
        raise ConfigError(f"{key}: {path!r} is a directory, not a JSONL or Parquet file")
    if not resolved.is_file():
        raise ConfigError(f"{key}: no such file: {path!r} (looked at {resolved})")
    return resolved


WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")
TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
"""A Hugging Face hub id: "name" (a top-level id such as gpt2) or "org/name" (huggingface_hub's repo id rule)."""


def is_hub_id(path: str) -> bool:
    return len(path) <= 96 and bool(HUB_ID.match(path)) and ".." not in path and not path.endswith((".", "-"))


def resolve_model_path(path: str, download: bool, key: str = "model.path") -> Path | None:
    """`model.path` as a local Hugging Face causal-LM dir: a dir as given, or a hub id from the local cache.

    The cache is Hugging Face's. A hub id is "org/name", or a top-level "name" such as gpt2; it is downloaded first when
    `download` (a run; a dry run never downloads: None when the id is not cached yet). A dir that is not a causal LM
    with weights and a tokenizer is a ConfigError."""
    local = Path(path).expanduser()
    if local.exists() or not is_hub_id(path):
        if not local.is_dir():
            raise ConfigError(f"{key}: {path!r} is neither a model dir nor a Hugging Face hub id (org/name or name)")
        return checked_model_dir(local, path, key)
    snapshot = hub_snapshot(path, download, key)
    return None if snapshot is None else checked_model_dir(snapshot, path, key)


def hub_snapshot(repo_id: str, download: bool, key: str) -> Path | None:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if not download and not constants.HF_HUB_OFFLINE:
        return None
    where = f"not in the local Hugging Face cache ({constants.HF_HUB_CACHE}; HF_HUB_CACHE or HF_HOME set it)"
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{key}: {repo_id!r} is {where} and HF_HUB_OFFLINE is set")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as e:  # no network, no such repo, no access: all the same to the user
        raise ConfigError(f"{key}: {repo_id!r} is {where} and could not be downloaded ({type(e).__name__})") from None


def checked_model_dir(folder: Path, path: str, key: str) -> Path:
    """The files verl and the tokenizer will read, checked without loading anything heavy."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {path!r} has no readable config.json ({type(e).__name__}) in {folder}") from None
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForCausalLM") for a in architectures):
        raise ConfigError(f"{key}: {path!r} is not a causal LM (architectures: {architectures}) in {folder}")
    if not any(any(folder.glob(pattern)) for pattern in WEIGHTS):
        raise ConfigError(f"{key}: {path!r} has no weights (*.safetensors or pytorch_model*.bin) in {folder}")
    if not any((folder / name).exists() for name in TOKENIZER):
        raise ConfigError(f"{key}: {path!r} has no tokenizer ({', '.join(TOKENIZER)}) in {folder}")
    return folder


def check_chat_template(model_path: str | None, where: str | None) -> None:
    """Chat rows (`where`: the first one) need the model's chat template.

    It is known from its files, without loading the tokenizer, so a dry run finds it missing. Skipped for the built tiny
    model (it has one) and for a hub id not cached yet (checked once downloaded, when the tokenizer is loaded before any
    worker starts)."""
    folder = resolve_model_path(model_path, download=False) if where and model_path else None
    if folder is None:
        return
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tokenizer_config = {}
    if not tokenizer_config.get("chat_template") and not (folder / "chat_template.jinja").exists():
        raise ConfigError(f"{where}: messages rows need a chat template, and the tokenizer of {model_path} has none")


def check(cfg: Config) -> None:
    """Check what no single group can check alone.

    That the batch splits over every worker into whole micro batches; the files named exist; the plan steps asked for
    are steps of the run."""
    from tinker_exp.config.rl import check_rl

    check_rl(cfg)  # an RL run's batch is its prompts x group size: checked there
    backend, batch = cfg.backend, cfg.trainer.batch_size
    workers = backend.num_workers * backend.nodes
    over = f"backend.num_workers={backend.num_workers}" + (f" x backend.nodes={backend.nodes}" if backend.nodes > 1 else "")
    if not cfg.env.active and (batch % workers or (batch // workers) % backend.micro_batch_size):
        raise ConfigError(
            f"trainer.batch_size={batch} must split evenly over {over} "
            f"into micro batches of backend.micro_batch_size={backend.micro_batch_size}"
        )
    check_throughput(cfg)
    if cfg.optimizer.name.value == "Muon" and cfg.lora.rank > 0:
        raise ConfigError(
            f"optimizer.name: Muon with lora.rank={cfg.lora.rank} is not supported (Muon splits the full model's "
            "weight matrices; LoRA trains adapters only): choose another optimizer with LoRA"
        )
    if cfg.optimizer.name.value == "AdamWScheduleFree" and cfg.env.active:
        raise ConfigError(
            "optimizer.name: AdamWScheduleFree with an env (RL) is not supported yet (the driver's sampler would "
            "sample the training point, not the averaged weights): use it for supervised runs"
        )
    data_path(cfg.data.path)
    if cfg.model.path:
        resolve_model_path(cfg.model.path, download=False)
    elif why := not_a_folder(Path(cfg.model.cache_dir).expanduser()):  # where the tiny model is built and kept
        raise ConfigError(f"model.cache_dir={cfg.model.cache_dir}: {why} ($TINKER_EXP_CACHE sets it)")
    if cfg.data.val_path is not None:
        data_path(cfg.data.val_path, "data.val_path")
    for i, step in enumerate(cfg.plan_steps):
        if not 0 <= step < cfg.trainer.steps:
            raise ConfigError(f"plan_steps[{i}]: {step} is not a step of this run (0 .. {cfg.trainer.steps - 1})")


def check_throughput(cfg: Config) -> None:
    """The throughput knobs against the optimizer and the data (docs/devices.md#throughput-knobs)."""
    from tinker_exp.config.schema import AUTO_MICRO_BATCH_TOKENS, FUSED_OPTIMIZERS, OptimizerKernel

    backend, name = cfg.backend, cfg.optimizer.name.value
    kernel = backend.optimizer_kernel
    if kernel is OptimizerKernel.fused and name not in FUSED_OPTIMIZERS:
        raise ConfigError(
            f"backend.optimizer_kernel=fused: optimizer.name={name} has no fused kernel in torch "
            f"(fused: {', '.join(FUSED_OPTIMIZERS)}); use foreach, for_loop or auto"
        )
    if kernel in (OptimizerKernel.foreach, OptimizerKernel.for_loop) and name == "Muon":
        raise ConfigError(f"backend.optimizer_kernel={kernel.value}: optimizer.name=Muon has no such choice; use auto")
    tokens, longest = backend.micro_batch_tokens, cfg.data.max_length
    if cfg.env.active:  # RL runs stay by sequences
        return
    if tokens is not None and 0 < tokens < longest:
        raise ConfigError(
            f"backend.micro_batch_tokens={tokens}: a micro batch must hold the longest sequence "
            f"(data.max_length={longest}); set it >= {longest}, or 0 (by sequences)"
        )
    if tokens is None and backend.device.value != "cpu" and longest > AUTO_MICRO_BATCH_TOKENS:
        raise ConfigError(
            f"backend.micro_batch_tokens=null: on cuda that is {AUTO_MICRO_BATCH_TOKENS} tokens a micro batch, less "
            f"than data.max_length={longest}; set backend.micro_batch_tokens >= {longest}, or 0 (by sequences)"
        )


def load(dcfg: DictConfig) -> Config:
    """The composed DictConfig as the typed Config; each group's own checks run here (`check` does the rest)."""
    from tinker_exp.config.compose_errors import as_config_error, unknown_key

    unknown = unknown_key(dcfg)  # a key added with + where the schema has none: to_object would drop it
    if unknown is not None:
        raise ConfigError(unknown)
    try:
        cfg = OmegaConf.to_object(dcfg)
    except OmegaConfBaseException as e:  # a value that does not resolve or convert (an ${oc.env:...}, say)
        raise as_config_error(e) from None
    assert isinstance(cfg, Config), f"not composed from the schema: {type(cfg).__name__}"
    return cfg


SLOT_KEYS = ("lora.rank", "backend.nodes")
"""What `why_not_on_slot` reads: a sweep that varies neither (nor a group holding one) has all its points judged alike."""


def why_not_on_slot(cfg: Config) -> str | None:
    """Why a run cannot train on a slot of a shared group (runtime/slots.py), or None.

    Slots hold LoRA runs (SFT, or RL with its sampler in its own driver thread) on one node."""
    if cfg.lora.rank == 0:
        return "lora.rank=0: full fine-tuning keeps one trial per group"
    if cfg.backend.nodes > 1:
        return f"backend.nodes={cfg.backend.nodes}: slots hold trials on one node"
    return None
