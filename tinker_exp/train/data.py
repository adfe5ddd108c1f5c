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

from tinker_exp.config import DataConfig, data_path
from tinker_exp.errors import ConfigError


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on the tokens the model is trained to produce (response + eos)


def read_rows(path: Path, prompt_key: str, response_key: str, key: str = "data.path") -> list[dict[str, str]]:
    """Every row of a JSONL file; `key` (the config key of the file) names it in errors."""
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{key}: {path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{key}: {path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        for field in (prompt_key, response_key):
            if not isinstance(row.get(field), str):
                raise ConfigError(f"{key}: {path}:{lineno}: missing string field {field!r}")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{key}: {path} has no rows")
    return rows


def split_rows(rows: list[dict[str, str]], fraction: float, seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(training rows, held-out rows), file order kept on both sides: round(fraction * distinct rows) distinct rows
    picked by `seed`, each with all its copies, so no validation row is also a training row."""
    keys = [json.dumps(row, sort_keys=True) for row in rows]
    distinct = list(dict.fromkeys(keys))
    held_out = set(random.Random(seed).sample(distinct, round(fraction * len(distinct))))
    return [r for r, k in zip(rows, keys) if k not in held_out], [r for r, k in zip(rows, keys) if k in held_out]


def dataset_rows(data: DataConfig) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(training rows, validation rows) as the config says, read and checked before any worker starts."""
    rows = read_rows(data_path(data.path), data.prompt_key, data.response_key)
    if data.val_path is not None:
        val_path = data_path(data.val_path, "data.val_path")
        return rows, read_rows(val_path, data.prompt_key, data.response_key, key="data.val_path")
    if data.val_fraction is None:
        return rows, []
    train, val = split_rows(rows, data.val_fraction, data.split_seed)
    if not val or not train:
        raise ConfigError(
            f"data.val_fraction: {data.val_fraction} of {len(rows)} rows leaves {len(train)} for training and "
            f"{len(val)} for validation (both need rows; null: no validation)"
        )
    return train, val


def eval_batches(examples: list[Example], batch_size: int) -> list[list[Example]]:
    """The validation set in batches of the training batch size (so they split over the workers like training
    batches); the last one is filled up with copies that carry no loss tokens."""
    batches = [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)]
    filler = Example(examples[0].input_ids, [0] * len(examples[0].loss_mask))
    batches[-1] = batches[-1] + [filler] * (batch_size - len(batches[-1]))
    return batches


def tokenize(rows: list[dict[str, str]], tokenizer: Any, data_cfg: DataConfig) -> list[Example]:
    examples = []
    for row in rows:
        bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]  # Qwen2's tokenizers have none
        prompt = bos + tokenizer.encode(row[data_cfg.prompt_key] + "\n", add_special_tokens=False)
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
