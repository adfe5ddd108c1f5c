"""Writes the shipped RL envs' prompt files in tinker_exp/assets (deterministic): digits_{train,eval}.jsonl and
arithmetic_{train,eval}.jsonl, the eval prompts disjoint from the training ones.

digits: requests for numbers (the reward, tinker_exp.rl.envs:digit_share, reads no other field).
arithmetic: "What is A op B?" with the integer "answer" (tinker_exp.rl.envs:arithmetic_answer checks it).
`--check` exits 1 when a shipped file differs from what this writes.

    python scripts/make_rl_prompts.py [--check]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "tinker_exp" / "assets"
DIGIT_REQUESTS = ["Count from {a} to {b}.", "Give me a number near {a}.", "Write a phone number.", "List {n} numbers.",
                  "What year comes after {y}?", "Write the digits of {a} backwards.", "How many days are in {n} weeks?",
                  "Give a number between {a} and {b}."]  # fmt: skip
OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def digits_prompts(rng: random.Random, count: int) -> list[dict]:
    seen: dict[str, None] = {}
    while len(seen) < count:
        template = rng.choice(DIGIT_REQUESTS)
        a = rng.randint(1, 50)
        prompt = template.format(a=a, b=a + rng.randint(3, 9), n=rng.randint(2, 6), y=rng.randint(1900, 2030))
        seen[prompt] = None
    return [{"prompt": prompt} for prompt in seen]


def arithmetic_prompts(rng: random.Random, count: int) -> list[dict]:
    rows: dict[str, int] = {}
    while len(rows) < count:
        op = rng.choice(list(OPERATIONS))
        a, b = (rng.randint(2, 12), rng.randint(2, 12)) if op == "*" else (rng.randint(1, 99), rng.randint(1, 99))
        rows[f"What is {a} {op} {b}? Answer with the number only."] = OPERATIONS[op](a, b)
    return [{"prompt": prompt, "answer": answer} for prompt, answer in rows.items()]


def files() -> dict[str, str]:
    """File name -> text: each env's rows drawn once, the first ones for training, the rest held out."""
    out = {}
    for env, make, train, held_out in (("digits", digits_prompts, 32, 8), ("arithmetic", arithmetic_prompts, 256, 64)):
        rows = make(random.Random(0), train + held_out)
        for split, part in (("train", rows[:train]), ("eval", rows[train:])):
            out[f"{env}_{split}.jsonl"] = "".join(json.dumps(row) + "\n" for row in part)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="compare with the shipped files instead of writing them")
    check = parser.parse_args().check
    for name, text in files().items():
        if check and (ASSETS / name).read_text() != text:
            sys.exit(f"{ASSETS / name} differs from what {__file__} writes")
        if not check:
            (ASSETS / name).write_text(text)


if __name__ == "__main__":
    main()
