"""PLACEHOLDER (rl-core) until rl-env's tinker_exp/rl lands: the digits reward and GRPO advantages."""

from __future__ import annotations

import math


def digits_reward(row: dict, response: str) -> float:
    return sum(c.isascii() and c.isdigit() for c in response) / max(len(response), 1)


def grpo(rewards: list[float], group_size: int) -> tuple[list[float], int]:
    out, degenerate = [], 0
    for i in range(0, len(rewards), group_size):
        g = rewards[i : i + group_size]
        mean = sum(g) / len(g)
        std = math.sqrt(sum((r - mean) ** 2 for r in g) / (len(g) - 1))
        degenerate += all(r == g[0] for r in g)
        out += [(r - mean) / (std + 1e-6) for r in g]
    return out, degenerate


def load_reward(spec: str):
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def prompt_rows(path: str, key: str) -> list[dict]:
    from tinker_exp.config import data_path
    from tinker_exp.formats import read_jsonl

    return read_jsonl(data_path(path, key))
