"""A generated SFT corpus in the laws' regime, with a held-out file for val/loss.

Distinct rows (sums, reversals, spellings, counts over random words), so a run of up to train_rows / batch_size steps
sees no row twice.

The shipped 256-row set is seen ~6 times in 200 steps: the tiny model memorises it, which no loss-curve law
describes (docs/forecast.md). Deterministic for a seed: the same rows on every machine. Pure Python.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("apple river cloud music window garden stone light paper table orange silver forest candle rocket "
         "pencil mirror bridge castle dragon ocean planet summer winter yellow purple jacket pocket basket "
         "hammer ladder marble needle rabbit saddle tunnel violin wallet zebra anchor bottle button cactus").split()  # fmt: skip
TRAIN_FILE, VAL_FILE = "corpus_train.jsonl", "corpus_val.jsonl"


def corpus_row(rng: random.Random) -> dict[str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(1000), rng.randrange(1000)
        return {"prompt": f"Add {a} and {b}.", "response": f" {a} plus {b} is {a + b}."}
    if kind == 1:
        words = rng.sample(WORDS, rng.randint(3, 5))
        return {"prompt": "Reverse: " + " ".join(words), "response": " " + " ".join(reversed(words))}
    if kind == 2:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 8)))
        return {"prompt": f"Spell {word}.", "response": " " + "-".join(word)}
    word, n = rng.choice(WORDS), rng.randint(2, 7)
    start = rng.randrange(50)
    return {"prompt": f"Count from {start} to {start + n - 1} with {word}.", "response": " " + " ".join(f"{word}{start + i}" for i in range(n))}


def write_corpus(out: Path, train_rows: int, val_rows: int, seed: int = 0) -> tuple[Path, Path]:
    """OUT/corpus_train.jsonl and OUT/corpus_val.jsonl: distinct prompts, none in both files."""
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < train_rows + val_rows:
        row = corpus_row(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    train, val = out / TRAIN_FILE, out / VAL_FILE
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:train_rows]), encoding="utf-8")
    val.write_text("".join(json.dumps(r) + "\n" for r in rows[train_rows:]), encoding="utf-8")
    return train, val
