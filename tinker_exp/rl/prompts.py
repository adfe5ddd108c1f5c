"""An env's prompt rows: read and checked before any worker starts; an error names the key, the file and the line.

A step's prompts are a pure function of (rows, step, seed) like the SFT data's batches: train.data.batch_for_step
over the rows (an epoch-wise permutation), so a resumed run samples from the same prompts without a cursor.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from tinker_exp.config import data_path
from tinker_exp.config.rl import EnvConfig
from tinker_exp.errors import ConfigError
from tinker_exp.formats import jsonl_records, kind_of

PROMPT_KEY = "prompt"
"""The field of a row that holds the prompt text (the other fields are the reward's)."""


@dataclass(frozen=True)
class PromptRow:
    """One prompt row as read: its text and the whole JSON object (what the reward gets)."""

    where: str  # "env.prompts: FILE:LINE": what errors name
    prompt: str
    fields_json: str  # the row's JSON object, kept as text so a reward cannot change the row for later calls

    def record(self) -> dict[str, Any]:
        """A fresh copy of the row's JSON object (the reward's first argument)."""
        return json.loads(self.fields_json)


def read_prompt_rows(path: str, key: str) -> list[PromptRow]:
    """Every row of a JSONL prompt file ("builtin:NAME": shipped), checked.

    `key` (env.prompts, env.eval_prompts) names it in errors."""
    resolved = data_path(path, key)
    if resolved.stat().st_size == 0:
        raise ConfigError(f"{key}: {resolved} is empty")
    rows = []
    for where, record in jsonl_records(resolved, key):
        where = f"{key}: {where}"
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: expected a JSON object with a {PROMPT_KEY!r} string, got {kind_of(record)}")
        prompt = record.get(PROMPT_KEY)
        if not isinstance(prompt, str) or not prompt.strip():
            got = "no such field" if PROMPT_KEY not in record else f"{kind_of(prompt)} {prompt!r}"[:60]
            raise ConfigError(f"{where}: {PROMPT_KEY!r} must be a non-empty string, got {got} (fields: {sorted(record)})")
        rows.append(PromptRow(where, prompt, json.dumps(copy.deepcopy(record))))
    if not rows:
        raise ConfigError(f"{key}: {resolved} has no rows")
    return rows


def env_rows(env: EnvConfig) -> tuple[list[PromptRow], list[PromptRow]]:
    """(training prompt rows, evaluation prompt rows: empty without env.eval_prompts)."""
    assert env.prompts is not None, "env_rows needs an env (env.prompts)"
    train = read_prompt_rows(env.prompts, "env.prompts")
    return train, [] if env.eval_prompts is None else read_prompt_rows(env.eval_prompts, "env.eval_prompts")


def check_prompt_lengths(rows: list[PromptRow], prompt_tokens: list[int], max_new_tokens: int, positions: int) -> None:
    """Check that each prompt plus env.max_new_tokens fits the model's `positions`; the first that does not is named.

    `prompt_tokens[i]`: prompt i's tokens as the sampler renders it."""
    for row, tokens in zip(rows, prompt_tokens, strict=True):
        if tokens + max_new_tokens > positions:
            raise ConfigError(
                f"{row.where}: the prompt is {tokens} tokens; with env.max_new_tokens={max_new_tokens} that is "
                f"{tokens + max_new_tokens}, more than the model's {positions} positions: shorten the prompt or "
                "lower env.max_new_tokens"
            )
