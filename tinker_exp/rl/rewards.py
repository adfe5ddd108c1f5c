"""Rewards: `env.reward=package.module:function` loaded and checked, and called so that a failure is one line.

A reward is any callable `function(row: dict, response: str) -> number`: the prompt row's JSON object and the
sampled response text. Whatever goes wrong in it (it raises, returns a non-number or a non-finite value) is a
RewardError naming env.reward, the prompt row and the response, never a traceback.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from tinker_exp.errors import ConfigError, RewardError, a_or_an, suggest
from tinker_exp.rl.prompts import PromptRow

SPEC = re.compile(r"^(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<name>[A-Za-z_]\w*)$")
SHOWN_CHARS = 40
"""How much of a response or an error message a one-line error shows."""


def _shown(value: Any) -> str:
    """repr(value), a long string cut to its first SHOWN_CHARS characters."""
    if isinstance(value, str) and len(value) > SHOWN_CHARS:
        return repr(value[:SHOWN_CHARS] + "...")
    shown = repr(value)
    return shown if len(shown) <= SHOWN_CHARS else shown[:SHOWN_CHARS] + "..."


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


@dataclass(frozen=True)
class Reward:
    """A loaded reward function; calling it returns a finite float or raises a RewardError."""

    spec: str  # as configured: "package.module:function"
    fn: Callable[[dict[str, Any], str], Any]
    key: str = "env.reward"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as the spec, imported again in the other process (a warm pool) as here.

        A function is pickled by its module and name, which a `module:name` bound to a lambda or an instance does not
        have."""
        return (load_reward, (self.spec, self.key))

    def __call__(self, row: PromptRow, response: str) -> float:
        at = f"{self.key}={self.spec}"
        try:
            value = self.fn(row.record(), response)
        except Exception as e:  # the user's code: any failure is theirs to see in one line
            raise RewardError(f"{at}: raised {_first_line(e)} on {row.where} (response {_shown(response)})") from None
        if not isinstance(value, numbers.Real):
            raise RewardError(
                f"{at}: returned {_shown(value)} ({type(value).__name__}), not a number, on {row.where} "
                f"(response {_shown(response)})"
            )
        value = float(value)
        if not math.isfinite(value):
            raise RewardError(f"{at}: returned {value}, not a finite number, on {row.where} (response {_shown(response)})")
        return value


def load_reward(spec: str, key: str = "env.reward") -> Reward:
    """Import the reward `package.module:function` and check that it can be called with (row, response).

    Imported from where the run starts: the current dir or an installed package."""
    match = SPEC.match(spec)
    if match is None:
        raise ConfigError(f"{key}: {spec!r} is not package.module:function")
    module_name, name = match["module"], match["name"]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"{key}: cannot import {module_name!r} ({_first_line(e)}); the module must be importable where the run "
            "starts (a file in the current directory or an installed package)"
        ) from None
    except Exception as e:  # a syntax error, or its own code failing at import
        raise ConfigError(f"{key}: importing {module_name!r} raised {_first_line(e)}") from None
    if not hasattr(module, name):
        known = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        listed = suggest(name, known, "its callables:") if known else " (it defines no public callable)"
        raise ConfigError(f"{key}: module {module_name!r} has no {name!r}" + listed)
    fn = getattr(module, name)
    if not callable(fn):
        raise ConfigError(f"{key}: {spec} is {a_or_an(type(fn).__name__)}, not a function")
    try:
        inspect.signature(fn).bind({}, "")
    except TypeError:
        raise ConfigError(f"{key}: {spec} must take (row, response); its signature is {inspect.signature(fn)}") from None
    except ValueError:  # a builtin without a signature: the first call will tell
        pass
    return Reward(spec, fn, key)


def check_reward(reward: Reward, rows: Iterable[PromptRow]) -> None:
    """Check, before any worker starts, that the reward gives a finite number for every row and an empty response.

    An empty response is one a model can produce. The first failure is a RewardError."""
    for row in rows:
        reward(row, "")
