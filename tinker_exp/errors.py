"""Every way a run stops on purpose: one exception each, carrying its exit status and one-line label.

The entry point (and a sweep's launcher) print ``tinker_exp: <label>: <message>`` and nothing else: a user's
mistake never shows a traceback. Pure Python.
"""

from __future__ import annotations

import difflib
import signal
import warnings
from pathlib import Path
from typing import Iterable


class TinkerExpError(Exception):
    """Base of the run's own errors. ``exit_code`` is the process's exit status, ``label`` its one-line prefix."""

    exit_code = 1
    label = "error"


class ConfigError(TinkerExpError, ValueError):
    """A config value is wrong. The message names the config key and the value. Raised before any worker starts."""

    exit_code = 2
    label = "config error"


class RewardError(ConfigError):
    """An env's reward function failed on a prompt row: it raised, or returned a non-number or a non-finite value.

    The message names env.reward, the row and the response. Found before any worker starts (the reward is tried on every
    prompt row) or during a run (the run stops; its last checkpoint stays as it was)."""

    label = "reward error"


class AppliedMismatchError(TinkerExpError, RuntimeError):
    """A param group on some rank does not hold what was sent: the run must not go on silently."""

    exit_code = 3
    label = "optimizer override not applied"


class NonFiniteError(TinkerExpError, RuntimeError):
    """More non-finite steps than trainer.max_nonfinite_steps allows."""

    exit_code = 4
    label = "stopped on non-finite values"


class CheckpointError(TinkerExpError, RuntimeError):
    """A checkpoint cannot be used; the message names the checkpoint and the file."""

    exit_code = 5
    label = "checkpoint error"


class WorkersStartError(TinkerExpError, RuntimeError):
    """The worker group could not start for a reason of the machine, not the config (its rendezvous port taken)."""

    label = "workers did not start"


class Terminated(SystemExit):
    """SIGTERM (scancel, preemption, requeue): raised in the loop so the run is closed before Slurm's SIGKILL.

    A SystemExit, not a TinkerExpError, on purpose: Hydra's run_job and submitit catch ``Exception`` and would
    record it as a failure. Let through, a sweep job that Slurm stops writes no result, and its launcher reads
    the job's fate (CANCELLED, or requeued and running again) from Slurm.
    """

    exit_code = 128 + signal.SIGTERM
    label = "stopped"
    MESSAGE = "terminated by SIGTERM (scancel, preemption or the end of the time limit)"

    def __init__(self, message: str = MESSAGE) -> None:
        super().__init__(self.exit_code)
        self.message = message

    def __str__(self) -> str:
        return self.message


STOPS = (TinkerExpError, Terminated)
"""What the entry point turns into one line and an exit status."""


def one_line(error: BaseException) -> str:
    """``config error: override.lr: ...``: the label and the message (a foreign error: its type and message)."""
    if isinstance(error, STOPS):
        return f"{error.label}: {error}"
    return f"{type(error).__name__}: {error}"


def suggest(name: str, known: Iterable[str], label: str) -> str:
    """ "; did you mean X? (LABEL: a, b)" with the closest known name (difflib), or just " (LABEL: a, b)"."""
    known = list(known)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.65)  # warmup -> warmup_steps; not nonexistent -> constant
    return (f"; did you mean {close[0]}?" if close else "") + f" ({label} {', '.join(known)})"


def a_or_an(word: str) -> str:
    """`word` after its indefinite article, as a message says it: an int, a float, an 8-step, an 11-step, a 100-step."""
    digits = word[: len(word) - len(word.lstrip("0123456789"))]
    if digits:  # as read aloud: eight..., eleven, eighteen (and their thousands, millions)
        vowel = digits.startswith("8") or (digits[:2] in ("11", "18") and len(digits) % 3 == 2)
    else:
        vowel = word[:1].lower() in "aeio" or (word[:1].lower() == "u" and not word.lower().startswith(("uni", "use", "usu")))
    return f"{'an' if vowel and word else 'a'} {word}"


def one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None) -> str:
    """Our own warnings as one line, as our errors are; a library's keep Python's form, with its file and line.

    Our own warnings: a broken checkpoint skipped, a leftover schedule parameter."""
    if Path(filename).resolve().is_relative_to(Path(__file__).resolve().parent):
        return f"tinker_exp: warning: {message}\n"
    return _python_format_warning(message, category, filename, lineno, line)


_python_format_warning = warnings.formatwarning
