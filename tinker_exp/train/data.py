"""SFT data: JSONL rows -> tokenized examples -> the batch for each step. Pure Python (the tokenizer is passed in).

The batch of a step is a pure function of (data, seed, step), so a resumed run sees the same data.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_exp.config import DataConfig
from tinker_exp.errors import ConfigError


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on the tokens the model is trained to produce (response + eos)


def read_rows(path: Path, prompt_key: str, response_key: str) -> list[dict[str, str]]:
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"data.path: {path}:{lineno}: not valid JSON ({e.msg})") from None
        for key in (prompt_key, response_key):
            if not isinstance(row.get(key), str):
                raise ConfigError(f"data.path: {path}:{lineno}: missing string field {key!r}")
        rows.append(row)
    if not rows:
        raise ConfigError(f"data.path: {path} has no rows")
    return rows


def tokenize(rows: list[dict[str, str]], tokenizer: Any, data_cfg: DataConfig) -> list[Example]:
    examples = []
    for row in rows:
        prompt = [tokenizer.bos_token_id] + tokenizer.encode(row[data_cfg.prompt_key] + "\n", add_special_tokens=False)
        response = tokenizer.encode(row[data_cfg.response_key], add_special_tokens=False) + [tokenizer.eos_token_id]
        ids = (prompt + response)[: data_cfg.max_length]
        mask = ([0] * len(prompt) + [1] * len(response))[: data_cfg.max_length]
        if sum(mask) > 0:
            examples.append(Example(ids, mask))
    return examples


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> tuple[int, ...]:
    order = list(range(n))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


def batch_for_step(examples: list[Example], step: int, batch_size: int, seed: int, shuffle: bool) -> list[Example]:
    """Epoch-wise permutation seeded by (seed, epoch); step k takes the k-th slice of that stream."""
    n = len(examples)
    positions = range(step * batch_size, (step + 1) * batch_size)
    return [examples[_epoch_order(n, seed, p // n, shuffle)[p % n]] for p in positions]
