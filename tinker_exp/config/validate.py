"""Checks across config groups (each group checks its own fields in its ``__post_init__``). Pure Python."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tinker_exp.config.schema import Config
from tinker_exp.errors import ConfigError

ASSETS = Path(__file__).resolve().parent.parent / "assets"
"""Where "builtin:NAME" data files live (shipped in the package)."""


def data_path(path: str, key: str = "data.path") -> Path:
    """A data file (`key` names it in errors): "builtin:NAME" is tinker_exp/assets/NAME; it must exist."""
    resolved = ASSETS / path.removeprefix("builtin:") if path.startswith("builtin:") else Path(path)
    if not resolved.is_file():
        raise ConfigError(f"{key}: no such file: {path!r} (looked at {resolved})")
    return resolved


def check(cfg: Config) -> None:
    """What no single group can check alone: the batch splits over every worker into whole micro batches."""
    backend, batch = cfg.backend, cfg.trainer.batch_size
    workers = backend.num_workers * backend.nodes
    over = f"backend.num_workers={backend.num_workers}" + (f" x backend.nodes={backend.nodes}" if backend.nodes > 1 else "")
    if batch % workers or (batch // workers) % backend.micro_batch_size:
        raise ConfigError(
            f"trainer.batch_size={batch} must split evenly over {over} "
            f"into micro batches of backend.micro_batch_size={backend.micro_batch_size}"
        )
    data_path(cfg.data.path)
    if cfg.data.val_path is not None:
        data_path(cfg.data.val_path, "data.val_path")


def load(dcfg: DictConfig) -> Config:
    """The composed DictConfig as the typed Config; each group's own checks run here (`check` does the rest)."""
    try:
        cfg = OmegaConf.to_object(dcfg)
    except OmegaConfBaseException as e:  # a value that does not resolve or convert (an ${oc.env:...}, say)
        from tinker_exp.config.compose_errors import as_config_error

        raise as_config_error(e) from None
    assert isinstance(cfg, Config), f"not composed from the schema: {type(cfg).__name__}"
    return cfg
