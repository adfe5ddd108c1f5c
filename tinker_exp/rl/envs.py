"""The shipped envs' rewards (conf/env/digits.yaml, conf/env/arithmetic.yaml name them as env.reward).

Each is an ordinary reward, `function(row, response) -> float`, loaded like yours.
"""

from __future__ import annotations

import re
from typing import Any

DIGITS = frozenset("0123456789")
INTEGER = re.compile(r"-?\d+")


def digit_share(row: dict[str, Any], response: str) -> float:
    """env=digits: the share of the response's characters that are ASCII digits (0 for an empty response).

    A toy task a randomly initialised model learns on CPU in about 40 steps. On the tiny model's tokenizer (byte-level
    BPE, 384 tokens) ten tokens are single digits and six are a space and a digit; a random policy's responses are
    about 2% digits. Counted in characters rather than tokens (the reward sees text, not token ids): a space-digit
    token earns half, a long word token costs as much as its length, so the signal is dense and graded, and an
    all-digit response scores 1 whatever its length. The shortcut of ending early is no better than a digit, so the
    policy learns digits (measured: docs/rl.md)."""
    if not response:
        return 0.0
    return sum(char in DIGITS for char in response) / len(response)


def arithmetic_answer(row: dict[str, Any], response: str) -> float:
    """env=arithmetic: 1.0 when the last integer in the response equals the row's "answer", else 0.0 (verifiable;
    made for real models, the tiny one does not learn it)."""
    found = INTEGER.findall(response)
    return 1.0 if found and int(found[-1]) == int(row["answer"]) else 0.0
