"""Writes tinker_exp/assets/tiny_chat.jsonl: the small chat data set shipped beside tiny_sft.jsonl (deterministic).

Conversations in `messages` rows: the tasks of tiny_sft (add, reverse, spell, count) with follow-up turns, some
with a system turn, some opened by a greeting. `--check` exits 1 when the shipped file differs from what this writes.

    python scripts/make_tiny_chat.py [--check]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tinker_exp" / "assets" / "tiny_chat.jsonl"
ROWS = 160
WORDS = ["apple", "river", "cloud", "stone", "garden", "north", "tiger", "table", "paper", "light", "green", "ocean",
         "window", "quiet"]  # fmt: skip
SYSTEMS = ["You are a helpful assistant.", "Answer in few words.", "You are a careful math tutor.", "Be brief."]
GREETINGS = [("Hi!", "Hello! How can I help?"), ("Hello there.", "Hi. What shall we do?"), ("Good morning.", "Good morning! Ask away.")]


def add(rng: random.Random) -> list[tuple[str, str]]:
    a, b = rng.randint(1, 60), rng.randint(1, 60)
    turns = [(f"Add {a} and {b}.", f"{a} plus {b} is {a + b}.")]
    total = a + b
    for _ in range(rng.randint(0, 2)):
        if total > 1 and rng.random() < 0.5:
            d = rng.randint(1, total - 1)
            turns.append((f"Now subtract {d}.", f"{total} minus {d} is {total - d}."))
            total -= d
        else:
            turns.append(("Double it.", f"{total} times 2 is {2 * total}."))
            total *= 2
    return turns


def reverse(rng: random.Random) -> list[tuple[str, str]]:
    words = rng.sample(WORDS, rng.randint(2, 4))
    turns = [(f"Reverse: {' '.join(words)}", " ".join(reversed(words)))]
    if rng.random() < 0.5:
        turns.append(("And sort them.", " ".join(sorted(words))))
    return turns


def spell(rng: random.Random) -> list[tuple[str, str]]:
    word = rng.choice(WORDS)
    turns = [(f"Spell {word}.", "-".join(word))]
    if rng.random() < 0.6:
        turns.append(("How many letters?", f"{len(word)} letters."))
    return turns


def count(rng: random.Random) -> list[tuple[str, str]]:
    word, n = rng.choice(WORDS), rng.randint(2, 4)
    return [(f"Count to {n} with {word}.", " ".join(f"{word}{i}" for i in range(1, n + 1)))]


def conversation(rng: random.Random) -> list[dict[str, str]]:
    turns = rng.choice([add, reverse, spell, count])(rng)
    if rng.random() < 0.25:
        turns = [rng.choice(GREETINGS), *turns]
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.4 else []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return messages


def text() -> str:
    rng = random.Random(0)
    return "".join(json.dumps({"messages": conversation(rng)}) + "\n" for _ in range(ROWS))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    if parser.parse_args().check:
        sys.exit(0 if OUT.read_text() == text() else f"{OUT} differs from what {__file__} writes")
    OUT.write_text(text())


if __name__ == "__main__":
    main()
