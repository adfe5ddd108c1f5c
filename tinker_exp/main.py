"""The CLI: `python -m tinker_exp OVERRIDES`.

Hydra composes the config; the run's steps (tinker_exp/run.py) validate and train it; errors become one line and an exit
code; a refused command leaves nothing behind (RunDirCheck).

Config errors and dry runs import no torch, verl or ray (see tinker_exp/run.py).
"""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from tinker_exp import config
from tinker_exp.config import CONF_DIR
from tinker_exp.config.compose_errors import one_line_compose_errors, refuse_unknown_flags
from tinker_exp.errors import STOPS, ConfigError, TinkerExpError, one_line, one_line_warning
from tinker_exp.formats import not_a_folder
from tinker_exp.run import hydra_output_files, name_sweep_job, run_and_score, sweep_job
from tinker_exp.sweep.jobs import job_info
from tinker_exp.train.checkpoints import resume_point
from tinker_exp.train.signals import SIGTERM_RECEIVED, sigterm_as_ctrl_c



def where_a_rerun_starts(dcfg: DictConfig, run_dir: Path) -> str:
    """For Ctrl-C's line: the checkpoint the same command continues from (its resume mode), or step 0."""
    try:
        cfg = config.load(dcfg)
        point = resume_point(run_dir / cfg.checkpoint.dir, cfg.resume.value)
    except TinkerExpError:  # resume=never with checkpoints, none usable, an invalid config: the rerun says why
        return ""
    if point is None:
        return "the same command starts again from step 0: no checkpoint yet"
    return f"the same command continues from {point.path}"


PROCESS_START = time.time()
"""When this process imported the entry, before Hydra made any run dir for its command."""


def made_for_this_command(run_dir: Path) -> bool:
    """Whether Hydra made a sweep job's (empty) run dir for this command.

    Hydra makes it before the task runs. Told by its change time, as Hydra does not say; on a shared file system whose
    clock runs ahead, an empty dir made just before may count as made now (and an empty dir is all that goes). A run's:
    `RunDirCheck` knows."""
    return run_dir.is_dir() and not any(run_dir.iterdir()) and run_dir.stat().st_ctime >= PROCESS_START


class RunDirCheck(Callback):
    """Hydra's callback (conf/config.yaml: hydra.callbacks), called before Hydra makes a run's dir (or a sweep's).

    A dir that cannot be a folder (a file is there, or above it) is refused in one line, and the topmost folder Hydra is
    about to make for a run is noted, so that a refused command removes what Hydra made, and only that."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        global HYDRA_MADE
        refuse_a_file(str(config.hydra.run.dir), "hydra.run.dir")
        run_dir = Path(str(config.hydra.run.dir)).absolute()
        HYDRA_MADE = next((at for at in reversed([run_dir, *run_dir.parents]) if not at.exists()), None)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        refuse_a_file(str(config.hydra.sweep.dir), "hydra.sweep.dir")


HYDRA_MADE: Path | None = None
"""The topmost folder Hydra makes for this run's dir (the run dir itself, or a parent it lacked), as `RunDirCheck`
found it before Hydra made it; None: the run dir was there."""


def refuse_a_file(path: str, key: str) -> None:
    why = not_a_folder(Path(path))
    if why:  # said and exited here: Hydra turns what a callback raises into a warning and goes on
        error = ConfigError(f"{key}={path}: {why}")
        print(f"tinker_exp: {one_line(error)}", file=sys.stderr)
        sys.exit(error.exit_code)


def remove_what_hydra_made(run_dir: Path, in_sweep: bool, made_now: bool) -> None:
    """Remove a refused command's run dir, made by Hydra for it and left empty.

    A run's parents Hydra made too (outputs/runs/DATE) go as well, each only while empty."""
    if not made_now:
        return
    top = run_dir if in_sweep or HYDRA_MADE is None else HYDRA_MADE
    for at in [run_dir, *run_dir.parents]:
        if not at.is_dir() or any(at.iterdir()):
            return
        drop_log_files_in(at)
        at.rmdir()
        if at == top:
            return


def drop_log_files_in(run_dir: Path) -> None:
    """Close and detach the log files Hydra set up in a run dir that goes.

    They were never opened: nothing was logged there yet. Detached so that a later record in this process does not fail
    on, or make again, a file in a removed dir."""
    loggers = [logging.getLogger(), *(l for l in logging.Logger.manager.loggerDict.values() if isinstance(l, logging.Logger))]
    for logger in loggers:
        for handler in list(logger.handlers):
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == run_dir.resolve():
                logger.removeHandler(handler)
                handler.close()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(dcfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    hydra_files = hydra_output_files(dcfg, hydra_cfg) if hydra_cfg.output_subdir is None else {}
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    task_overrides = list(hydra_cfg.overrides.task)
    if in_sweep:
        name_sweep_job(dcfg, str(hydra_cfg.sweep.dir), task_overrides, run_dir)
    if dcfg.get("verbose"):  # libraries' log records on the terminal too (the run dir's log has them anyway)
        ours = logging.getLogger("tinker_exp")
        logging.getLogger().handlers += ours.handlers
        ours.handlers = []
    job = job_info(hydra_cfg.job.get("num") if in_sweep else None, task_overrides)
    made_now = made_for_this_command(run_dir) if in_sweep else HYDRA_MADE is not None and run_dir.absolute().is_relative_to(HYDRA_MADE)
    choices = dict(hydra_cfg.runtime.choices)
    try:
        if in_sweep:
            from tinker_exp.sweep.prefixes import role_of

            prefix = role_of(str(hydra_cfg.sweep.dir), job["num"])  # a grid point's part in shared prefixes, if any
            return sweep_job(dcfg, run_dir, choices, job, hydra_files, made_now, prefix=prefix)
        try:
            return run_and_score(dcfg, run_dir, choices, job, hydra_files)
        except STOPS as e:
            print(f"tinker_exp: {one_line(e)}", file=sys.stderr)
            sys.exit(e.exit_code)
    except KeyboardInterrupt as e:
        if in_sweep:
            raise
        raise KeyboardInterrupt(where_a_rerun_starts(dcfg, run_dir)) from e
    finally:
        remove_what_hydra_made(run_dir.absolute(), in_sweep, made_now)  # refused: nothing of it stays


@functools.cache
def freeze_heap_at_exit() -> None:
    """At the process's exit, leave every object to the OS instead of collecting it.

    The interpreter's last garbage collections walk all that torch, verl and Ray built, for memory the OS frees at once
    (docs/devices.md has the times). Registered once; runs after the run is over (its files closed, its workers freed),
    so it changes nothing a run writes."""
    atexit.register(gc.freeze)


def main() -> None:
    freeze_heap_at_exit()
    config.register()
    config.cli_help.show_if_asked(sys.argv[1:])
    warnings.formatwarning = one_line_warning
    try:
        with one_line_compose_errors(), sigterm_as_ctrl_c():  # compose errors: one line and exit 2, as every config error
            refuse_unknown_flags(sys.argv[1:])
            _hydra_main()
    except KeyboardInterrupt as e:  # Ctrl-C (or SIGTERM): what was running is stopped (a sweep's jobs cancelled); no traceback
        stopped, status = ("terminated (SIGTERM)", 143) if SIGTERM_RECEIVED.is_set() else ("interrupted (Ctrl-C)", 130)
        print(f"tinker_exp: {stopped}" + (f"; {e}" if str(e) else ""), file=sys.stderr)
        sys.exit(status)


if __name__ == "__main__":
    main()
