"""An env ready to run: its prompt rows and its reward, loaded and checked together before any worker starts."""

from __future__ import annotations

from dataclasses import dataclass

from tinker_exp.config.rl import EnvConfig
from tinker_exp.rl.prompts import PromptRow, env_rows
from tinker_exp.rl.rewards import Reward, check_reward, load_reward


@dataclass(frozen=True)
class Env:
    name: str  # env.name, or "custom" for your own
    train: list[PromptRow]
    eval: list[PromptRow]  # empty without env.eval_prompts
    reward: Reward


def load_env(env: EnvConfig) -> Env:
    """Load and check an env before any worker starts.

    Read and check the prompt rows, import the reward and try it on every row with an empty response: every bad input is
    a one-line ConfigError (RewardError for the reward's own failures) here, not in the run."""
    train, held_out = env_rows(env)
    assert env.reward is not None  # EnvConfig requires it with prompts
    reward = load_reward(env.reward)
    check_reward(reward, train + held_out)
    return Env(env.name or "custom", train, held_out, reward)
