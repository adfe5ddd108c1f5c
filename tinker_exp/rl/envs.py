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
    about 4% digits. Counted in characters, not tokens, because a reward sees text: a space-digit token earns half, a
    long word token costs as much as its length, so the signal is graded; an all-digit response scores 1 whatever
    its length. Measured with the spike's loop (GRPO, 4 prompts x 8 samples, 8 new tokens, lr_cosine): mean reward
    of the first 5 steps 0.040, of the last 5 steps 0.999 at lr 1e-2 (full-length all-digit responses, not the
    shortcut of stopping after one digit), but 0.038 -> 0.056 at the optimizer's default 1e-3, so conf/env/digits.yaml
    sets lr 1e-2."""
    if not response:
        return 0.0
    return sum(char in DIGITS for char in response) / len(response)


def arithmetic_answer(row: dict[str, Any], response: str) -> float:
    """env=arithmetic's reward: 1.0 when the last integer in the response equals the row's "answer", else 0.0.

    Verifiable; made for real models, the tiny one does not learn it."""
    found = INTEGER.findall(response)
    return 1.0 if found and int(found[-1]) == int(row["answer"]) else 0.0
