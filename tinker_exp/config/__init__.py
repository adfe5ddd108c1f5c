"""Config: the typed schema (defaults, meanings, per-group checks) and the checks across groups. Pure Python."""

from pathlib import Path

from tinker_exp.config import cli_help, schema
from tinker_exp.config.schema import (
    BackendConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    LoggerConfig,
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
    TrainerConfig,
)
from tinker_exp.config.validate import check, check_chat_template, data_path, load, resolve_model_path

CONF_DIR = str(Path(__file__).resolve().parent.parent.parent / "conf")
"""The repo's conf/: what `python -m tinker_exp`, the pool, the server and a forecast's plans compose from."""


def register() -> None:
    """Before composing (idempotent): the schema in Hydra's ConfigStore, the --help template's resolver."""
    schema.register()
    cli_help.register()


__all__ = [
    "CONF_DIR",
    "BackendConfig",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LoggerConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimizerConfig",
    "TrainerConfig",
    "check",
    "data_path",
    "resolve_model_path",
    "check_chat_template",
    "load",
    "register",
]
