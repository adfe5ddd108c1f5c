"""Config: the typed schema (defaults, meanings, per-group checks) and the checks across groups. Pure Python."""

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
    register,
)
from tinker_exp.config.validate import check, check_chat_template, data_path, load, resolve_model_path

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
