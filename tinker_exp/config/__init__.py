"""Config: the typed schema (defaults, meanings, per-group checks) and the checks across groups. Pure Python."""

from pathlib import Path
from typing import Any

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


def compose_dict(overrides: list[str], config_dir: str | Path | None = None, job_name: str = "tinker_exp") -> Any:
    """The DictConfig `python -m tinker_exp OVERRIDES` composes (no `hydra` node), for compositions outside the CLI.

    Used by the pool, the server, a forecast's plans; a compose error is our one-line ConfigError. `config_dir`: a
    folder searched before conf/ (a forecast's own presets). Hydra's global state is left as it was found."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    from tinker_exp.config.compose_errors import COMPOSE_ERRORS, as_config_error

    register()
    extra = [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"] if config_dir else []
    outer = get_gh_backup()  # a caller inside a Hydra app (a sweep's job) keeps its own
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name=job_name):
            return compose(config_name="config", overrides=[*overrides, *extra])
    except COMPOSE_ERRORS as e:  # the override grammar's mistakes, as the CLI says them
        raise as_config_error(e) from None
    finally:
        restore_gh_from_backup(outer)


def compose(overrides: list[str], config_dir: str | Path | None = None, job_name: str = "tinker_exp") -> Config:
    """The typed Config `python -m tinker_exp OVERRIDES` runs with (`compose_dict`, then `load`: each group's checks)."""
    return load(compose_dict(overrides, config_dir, job_name))


__all__ = [
    "CONF_DIR",
    "compose",
    "compose_dict",
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
