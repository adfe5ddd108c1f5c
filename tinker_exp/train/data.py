"""SFT data: rows (JSONL or Parquet; prompt/response or messages) -> tokenized examples -> the batch for each step.

Pure Python: the tokenizer is passed in; pyarrow is imported only to read a Parquet file. Every row is read and
checked before any worker starts; an error names the config key, the file and the row.
The batch of a step is a pure function of (data, seed, step), so a resumed run sees the same data.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from tinker_exp.config import DataConfig, data_path
from tinker_exp.errors import ConfigError
from tinker_exp.formats import jsonl_records, kind_of
from tinker_exp.train.chat import chat_tokens, check_chat_tokenizer, special_ids
from tinker_exp.train.protocols import Batch

ROLES = ("system", "user", "assistant")
PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on the tokens the model learns to produce: response + eos; each assistant turn + its end


@dataclass(frozen=True)
class Row:
    """One row as read and checked: prompt/response, or a conversation (`messages` is then not None)."""

    where: str  # "data.path: FILE:LINE" (JSONL) or "data.path: FILE: row I" (Parquet, I from 0): what errors name
    origin: str  # "data.path: FILE"
    prompt: str = ""
    response: str = ""
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) per turn

    @property
    def identity(self) -> str:
        """Its content, not where it is: equal rows go to the same side of the split."""
        if self.messages is None:  # the same key as a plain {"prompt", "response"} JSON row always had
            return json.dumps({"prompt": self.prompt, "response": self.response}, sort_keys=True)
        return json.dumps({"messages": self.messages})


def _parquet_records(path: Path, data: DataConfig, key: str) -> Iterator[tuple[str, Any]]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
        columns = [c for c in names if c in (data.messages_key, data.prompt_key, data.response_key)]
        records = pq.read_table(path, columns=columns).to_pylist()
    except (pyarrow.ArrowException, OSError) as e:
        raise ConfigError(f"{key}: {path}: not a valid Parquet file ({str(e).splitlines()[0]})") from None
    for i, record in enumerate(records):
        yield f"{path}: row {i}", record


def _row_format(record: dict[str, Any], data: DataConfig, where: str) -> str:
    """data.format, or with auto what the first row of a file holds."""
    if data.format.value != "auto":
        return data.format.value
    if data.messages_key in record:
        return "messages"
    if data.prompt_key in record or data.response_key in record:
        return "prompt_response"
    raise ConfigError(
        f"{where}: neither a {data.messages_key!r} field (messages rows) nor {data.prompt_key!r} and "
        f"{data.response_key!r} (prompt/response rows); fields: {sorted(record)}"
    )


def _prompt_response_row(record: dict[str, Any], data: DataConfig, where: str, origin: str) -> Row:
    for field in (data.prompt_key, data.response_key):
        if not isinstance(record.get(field), str):
            raise ConfigError(f"{where}: missing string field {field!r}")
    return Row(where, origin, prompt=record[data.prompt_key], response=record[data.response_key])


def _messages_row(record: dict[str, Any], data: DataConfig, where: str, origin: str) -> Row:
    messages, name = record.get(data.messages_key), data.messages_key
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if messages == [] else kind_of(messages)
        raise ConfigError(f"{where}: {name!r} must be a non-empty list of {{role, content}} turns, got {got}")
    turns = []
    for i, message in enumerate(messages):
        at = f"{where}: {name}[{i}]"
        if not isinstance(message, dict):
            raise ConfigError(f"{at}: expected an object with role and content, got {kind_of(message)}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            what = "no role" if "role" not in message else f"unknown role {role!r}"
            raise ConfigError(f"{at}: {what} (known: {', '.join(ROLES)})")
        if not isinstance(content, str):
            got = "nothing" if "content" not in message else kind_of(content)
            raise ConfigError(f"{at}: content must be a string, got {got}")
        turns.append((role, content))
    if not any(role == "assistant" for role, _ in turns):
        raise ConfigError(f"{where}: the conversation has no assistant turn (nothing to train on)")
    return Row(where, origin, messages=tuple(turns))


def read_rows(path: Path, data: DataConfig, key: str = "data.path") -> list[Row]:
    """Every row of a JSONL or Parquet file, checked; `key` (the config key of the file) names it in errors."""
    if path.stat().st_size == 0:
        raise ConfigError(f"{key}: {path} is empty")
    parquet = path.suffix.lower() in PARQUET_SUFFIXES
    records = _parquet_records(path, data, key) if parquet else jsonl_records(path, key)
    origin, row_format, rows = f"{key}: {path}", None, []
    for where, record in records:
        where = f"{key}: {where}"
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {kind_of(record)}")
        row_format = row_format or _row_format(record, data, where)
        read = _messages_row if row_format == "messages" else _prompt_response_row
        rows.append(read(record, data, where, origin))
    if not rows:
        raise ConfigError(f"{key}: {path} has no rows")
    return rows


def split_rows(rows: list[Row], fraction: float, seed: int) -> tuple[list[Row], list[Row]]:
    """(training rows, held-out rows), file order kept on both sides; no validation row is also a training row.

    round(fraction * distinct rows) distinct rows are picked by `seed`, each with all its copies."""
    keys = [row.identity for row in rows]
    distinct = list(dict.fromkeys(keys))
    held_out = set(random.Random(seed).sample(distinct, round(fraction * len(distinct))))
    return [r for r, k in zip(rows, keys) if k not in held_out], [r for r, k in zip(rows, keys) if k in held_out]


def dataset_rows(data: DataConfig) -> tuple[list[Row], list[Row]]:
    """(training rows, validation rows) as the config says, read and checked before any worker starts."""
    rows = read_rows(data_path(data.path), data)
    if data.val_path is not None:
        return rows, read_rows(data_path(data.val_path, "data.val_path"), data, key="data.val_path")
    if data.val_fraction is None:
        return rows, []
    train, val = split_rows(rows, data.val_fraction, data.split_seed)
    if not val or not train:
        raise ConfigError(
            f"data.val_fraction: {data.val_fraction} of {len(rows)} rows leaves {len(train)} for training and "
            f"{len(val)} for validation (both need rows; null: no validation)"
        )
    return train, val


@dataclass(frozen=True)
class Tokenized:
    """A set of rows as examples, and what data.max_length did to them (the start of a run reports it)."""

    examples: list[Example]
    rows: int
    cut: int = 0  # longer than data.max_length, cut (truncation right or left)
    too_long: int = 0  # longer than data.max_length, dropped (truncation drop)
    untrained: int = 0  # dropped: no trained token left after the cut

    def describe(self, data: DataConfig) -> str:
        """`144 rows: 3 cut to 128 tokens (right), 1 dropped (1 with no trained token left)`."""
        dropped = [f"{n} {why}" for n, why in ((self.too_long, f"longer than {data.max_length} tokens"),
                                               (self.untrained, "with no trained token left")) if n]  # fmt: skip
        return (
            f"{self.rows} rows: {self.cut} cut to {data.max_length} tokens ({data.truncation.value}), "
            f"{self.too_long + self.untrained} dropped" + (f" ({', '.join(dropped)})" if dropped else "")
        )


def _prompt_response_tokens(row: Row, tokenizer: Any) -> tuple[list[int], list[int]]:
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]  # Qwen2's tokenizers have none
    prompt = bos + tokenizer.encode(row.prompt + "\n", add_special_tokens=False)
    response = tokenizer.encode(row.response, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt + response, [0] * len(prompt) + [1] * len(response)


def tokenize(rows: list[Row], tokenizer: Any, data: DataConfig, name: str = "training") -> Tokenized:
    """The rows as examples, then data.truncation for rows longer than data.max_length.

    prompt/response joined by a newline (bos, eos added), messages through the tokenizer's chat template. `name`: the
    set, in errors."""
    conversation, specials = next((row for row in rows if row.messages is not None), None), set()
    if conversation is not None:
        check_chat_tokenizer(tokenizer, conversation.where)
        specials = special_ids(tokenizer)
    n, truncation = data.max_length, data.truncation.value
    examples, cut, too_long, untrained = [], 0, 0, 0
    for row in rows:
        if row.messages is None:
            ids, mask = _prompt_response_tokens(row, tokenizer)
        else:
            messages = [{"role": role, "content": content} for role, content in row.messages]
            ids, mask = chat_tokens(messages, tokenizer, row.where, specials)
        if len(ids) > n:
            if truncation == "error":
                raise ConfigError(f"{row.where}: {len(ids)} tokens, more than data.max_length={n} (data.truncation=error)")
            if truncation == "drop":
                too_long += 1
                continue
            cut += 1
            ids, mask = (ids[:n], mask[:n]) if truncation == "right" else (ids[-n:], mask[-n:])
        if not any(mask):
            untrained += 1
            continue
        examples.append(Example(ids, mask))
    if rows and not examples:
        raise ConfigError(
            f"{rows[0].origin}: every {name} row is dropped at data.max_length={n} (data.truncation={truncation}): "
            f"{too_long} longer, {untrained} with no trained token left"
        )
    return Tokenized(examples, len(rows), cut, too_long, untrained)


def eval_batches(examples: list[Example], batch_size: int) -> list[list[Example]]:
    """The validation set in batches of the training batch size, so they split over the workers like training batches.

    The last one is filled up with copies that carry no loss tokens."""
    batches = [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)]
    filler = Example(examples[0].input_ids, [0] * len(examples[0].loss_mask))
    batches[-1] = batches[-1] + [filler] * (batch_size - len(batches[-1]))
    return batches


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


@dataclass(frozen=True)
class DataFileBatches:
    """The data file as a batch source (train/protocols.py `BatchSource`); it keeps no state.

    Step s's batch is `batch_for_step`'s, a function of (examples, batch size, seed, s)."""

    examples: list[Example]
    batch_size: int
    seed: int
    shuffle: bool

    def batch(self, step: int) -> Batch:
        return Batch(batch_for_step(self.examples, step, self.batch_size, self.seed, self.shuffle))

    def state(self) -> dict[str, Any]:
        return {}

    def restore(self, state: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
