"""PLACEHOLDER (rl-core) until rl-env's config/rl.py lands: the `env`, `rl` and `loss` nodes. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tinker_exp.errors import ConfigError


@dataclass
class EnvConfig:
    name: str = "digits"
    prompts: str = "builtin:digits_prompts.jsonl"
    eval_prompts: Optional[str] = None
    reward: str = "tinker_exp.rl.placeholder:digits_reward"
    max_new_tokens: int = 8


@dataclass
class RLConfig:
    group_size: int = 8
    prompts_per_step: int = 4
    temperature: float = 1.0
    advantage: str = "grpo"
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ConfigError(f"rl.group_size: must be >= 2, got {self.group_size!r}")


@dataclass
class LossConfig:
    name: str = "cross_entropy"
    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.2


def check_rl(cfg) -> None:
    if cfg.env is None and cfg.loss.name != "cross_entropy":
        raise ConfigError(f"loss={cfg.loss.name}: an RL loss needs an env (env=digits, or env.prompts=... env.reward=...)")
    if cfg.env is not None and cfg.loss.name == "cross_entropy":
        raise ConfigError(f"env={cfg.env.name}: RL needs an RL loss (loss=importance_sampling, ppo, cispo or dro), not cross_entropy")
