"""Hydra's own compose errors (a wrong type on the CLI, an unknown key or option) as our one-line config errors.

Hydra prints them over several lines and exits 1; every other config error of ours is one line naming the key,
exit 2. Hydra reports through ``hydra._internal.utils.run_and_report``, which is internal API: within
``one_line_compose_errors`` a guard around the function it runs turns those errors into ours first. Pure Python.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf.errors import OmegaConfBaseException

from tinker_exp.errors import ConfigError, TinkerExpError, one_line

COMPOSE_ERRORS = (ConfigCompositionException, OverrideParseException, OmegaConfBaseException)


def compose_message(error: BaseException) -> str:
    """One line: the key and what is wrong with its value (OmegaConf's words), else Hydra's first line."""
    if isinstance(error, OverrideParseException):  # the CLI text itself does not parse
        return f"{error.override!r}: {error.message.strip().splitlines()[0]}"
    cause = error if isinstance(error, OmegaConfBaseException) else error.__cause__
    head = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(cause, OmegaConfBaseException):
        message = (getattr(cause, "msg", None) or str(cause)).strip().splitlines()[0]
        key = getattr(cause, "full_key", None)
        return f"{key}: {message}" if key else (message if cause is error else f"{head}: {message}")
    return head


def as_config_error(error: BaseException) -> ConfigError:
    return ConfigError(compose_message(error))


@contextmanager
def one_line_compose_errors() -> Iterator[None]:
    from hydra._internal import utils as hydra_utils
    from hydra.errors import InstantiationException

    original = hydra_utils.run_and_report

    def stop(error: TinkerExpError) -> None:
        print(f"tinker_exp: {one_line(error)}", file=sys.stderr)
        sys.exit(error.exit_code)

    def run_and_report(func: Callable[[], Any]) -> Any:
        def guarded() -> Any:
            try:
                return func()
            except InstantiationException as e:  # a launcher or sweeper refusing its keys: ours in one line
                if not isinstance(e.__cause__, TinkerExpError):
                    raise
                stop(e.__cause__)
            except (*COMPOSE_ERRORS, TinkerExpError) as e:  # ours too: a sweeper's config error (its search space)
                stop(e if isinstance(e, TinkerExpError) else as_config_error(e))

        return original(guarded)

    hydra_utils.run_and_report = run_and_report
    try:
        yield
    finally:
        hydra_utils.run_and_report = original
