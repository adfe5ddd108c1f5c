"""Config: the typed schema (defaults, meanings, per-group checks) and the checks across groups. Pure Python."""

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


def register() -> None:
    """Before composing (idempotent): the schema in Hydra's ConfigStore, the --help template's resolver."""
    schema.register()
    cli_help.register()


__all__ = [
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
