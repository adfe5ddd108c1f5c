"""`python -m tinker_exp` without paying Python's start-up and the CLI's own imports for every call (helpers.run_cli).

Run as a script, it imports what `tinker_exp/__main__.py` imports first (tinker_exp.main: Hydra, OmegaConf, our
config; one thread, nothing started) and, with a CPU build of torch, what a CPU run imports once it starts its
workers (preload: torch, verl, Ray, transformers, matplotlib, with the platform environment such a run sets
first). Then it takes requests on a unix socket (`serve`; one JSON line a connection): {"args", "env", "cwd",
"stdout", "stderr", "default_sigint"} (args: what follows `python` on its command line, `-m MODULE ARGS` for
tinker_exp or another of ours, or `SCRIPT ARGS` for a file such as tests/fake_cli.py; as tests/zygotes.py's
requests). For each it forks; the parent answers {"pid"} at once and {"rc"} when the child has ended; the child
leaves the loop and becomes that command in that cwd and environment, its stdin /dev/null and its stdout/stderr
those files (one file for both where they name the same), and ends as that process would (threads joined, atexit handlers, exit status, a traceback on an uncaught exception),
less the teardown of its modules (`end`). Imports print
nothing and start no thread, and the state they leave that a run could see is put back as a fresh process has it:
the environment (what the imports set, they set again in the child), the root logger, and the process's start
(tinker_exp.main.PROCESS_START). helpers.run_cli falls back to a fresh process for an environment that changes what
these imports read (helpers.ZYGOTE_UNSAFE_ENV).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def preload() -> dict[str, str]:
    """Import what a CPU training run imports after tinker_exp.main (torch, verl, Ray, transformers, matplotlib:
    about 8 CPU-s per run otherwise) with the platform environment a CPU run sets before it imports verl
    (workers.platform_env), so each child starts with them imported, as a run is once it reaches its workers. Not
    W&B: a resumed run's W&B part, imported here, held no row (test_resume's SIGKILL test).
    Returns the variables the imports themselves set (verl's and Ray's setdefaults, which a fresh process has from
    its imports on); os.environ and the root logger are left as they were (verl's import-time basicConfig does
    nothing in a run, whose logging Hydra has set up first). Not with a CUDA build of torch: the parent of every
    run must not have touched CUDA, and a GPU machine's runs resolve another platform."""
    import contextlib
    import importlib.metadata
    import logging

    if "+cpu" not in importlib.metadata.version("torch"):
        return {}
    from tinker_exp.runtime.workers import platform_env

    before, platform = dict(os.environ), platform_env("cpu")
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    os.environ.update(platform)
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the answers' pipe
        import matplotlib.pyplot  # noqa: F401
        import transformers  # noqa: F401
        import verl.single_controller.ray  # noqa: F401
        import verl.workers.engine_workers_tinker  # noqa: F401

        import tinker_exp.assemble  # noqa: F401
        import tinker_exp.sweep.report  # noqa: F401
        import tinker_exp.train.loop  # noqa: F401
        from tinker_exp import config

        config.register()  # what main() does first (again in each child, where the schema is there already)
    added = {key: value for key, value in os.environ.items() if key not in before and key not in platform}
    os.environ.clear()
    os.environ.update(before)
    root.handlers[:] = handlers
    root.setLevel(level)
    return added


def warm_up() -> None:
    """What every dry run does first, done once here so that each child starts warm, writing nothing: compose the
    config (Hydra's API; its global state is cleared after), type it, build its plan, draw plan.png into memory.
    Their first use costs a child about 0.05 CPU-s of its 0.6 otherwise (8 forked dry runs, means 0.55 and 0.60:
    the override grammar's parser caches, OmegaConf's typing of the schema, numpy's and matplotlib's first calls). Warnings are ignored here
    without being remembered (a child still prints each once)."""
    import io
    import warnings

    import matplotlib.pyplot as plt
    from hydra import compose, initialize_config_dir

    import tinker_exp.main
    from tinker_exp import config
    from tinker_exp.optim import build_plan
    from tinker_exp.optim.preview import Part, draw_plan

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with initialize_config_dir(version_base="1.3", config_dir=tinker_exp.main.CONF_DIR):
            cfg = config.load(compose("config", overrides=["+override=lr_cosine"]))
        plan = build_plan(cfg.override, cfg.optimizer, cfg.trainer.steps)
        figure = draw_plan(plan, [Part(Path(os.devnull))])
        figure.savefig(io.BytesIO(), format="png", dpi=100)
        plt.close(figure)


SOCKETS_ENV = "TINKER_EXP_CLI_ZYGOTE"
"""The folder of the zygote's two sockets: `cli` (a test process's requests, one a connection) and `job` (local sweep
jobs, tests/zygotes.py's client: their drivers fork from here too, unless the session has a job server of its own)."""


def serve() -> tuple[str, dict, dict[str, str]]:
    """The zygote's loop, until its stdin closes; returns (in a forked child only) what it is to become ("cli": a
    test process's request; "job": a local sweep job's), that request, and what preload's imports set in the
    environment. Children run side by side (both xdist workers' runs, a run holding a run dir while another asks
    for it, a sweep's jobs). Each is answered on its connection {"pid"} once forked and {"rc"} once ended; a
    connection closed before that (its test process killed) kills its child."""
    import gc
    import socket

    import zygotes

    folder = os.environ[SOCKETS_ENV]
    listeners = {}
    for kind in ("cli", "job"):  # at once: who comes while the imports run waits in the backlog
        listeners[kind] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listeners[kind].bind(os.path.join(folder, kind))
        listeners[kind].listen(64)
    imports_set = zygotes.preload("job")  # a CLI run's imports (`preload`), and what a job's driver adds to them
    write_seen(folder, imports_set)
    warm_up()  # after those imports (the other way round, a job's result did not pickle: cloudpickle looked a class up in every module)
    gc.freeze()  # the children's collections leave the imported objects alone: no copy of the pages they are on
    log = os.environ.get(zygotes.LOG_ENV) or os.path.join(folder, "job.log")
    readers = {"cli": lambda conn: json.loads(_read_line(conn)), "job": lambda conn: {**zygotes.receive(conn), "log": log}}
    kind, request = zygotes.fork_loop(listeners, readers)
    return kind, request, imports_set


SEEN_FILE = "seen.json"
"""In the zygote's folder, once its imports ran: {"seen": the environment they saw, "added": what the zygote put
there for them (the CPU platform's variables) or they set themselves}. A run whose environment differs there gets a
fresh process (helpers)."""


def write_seen(folder: str, imports_set: dict[str, str]) -> None:
    import importlib.metadata

    from tinker_exp.runtime.workers import platform_env

    added = {**(platform_env("cpu") if "+cpu" in importlib.metadata.version("torch") else {}), **imports_set}
    path = os.path.join(folder, SEEN_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump({"seen": {**os.environ, **added}, "added": added}, f)
    os.replace(path + ".tmp", path)  # whole or not at all: a test process waits for it


def _read_line(conn) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ValueError("request cut short")
        line += chunk
    return line


def exit_status(stop: SystemExit) -> int:
    """The status Python exits with for an uncaught SystemExit (printing a message given instead of a number)."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code & 0xFF
    print(stop.code, file=sys.stderr)
    return 1


def end(status: int | None) -> None:
    """What Python does at exit, but the teardown of every module (about 0.5 s in a process that imported torch and
    verl, for nothing the run could see): join the threads that are not daemons, run the atexit handlers, flush
    stdout and stderr, exit with `status` (None: killed by SIGINT, as an uncaught KeyboardInterrupt ends Python)."""
    import atexit
    import signal
    import threading

    threading._shutdown()  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if status is None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def run_to_end(main) -> None:
    """`main()` as a process's __main__, then the end Python gives it (`end`): its exit status, a KeyboardInterrupt's
    SIGINT, or the traceback and status 1."""
    try:
        main()
    except SystemExit as stop:
        end(exit_status(stop))
    except KeyboardInterrupt:
        end(None)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        end(1)
    end(0)


if __name__ == "__main__":
    kind, request, imports_set = serve()
    if kind == "job":
        import zygotes

        zygotes.become("job", request, imports_set)  # ends the process
    import time

    import tinker_exp.main

    # What a fresh process sets as it imports the entry (the only module-level state of tinker_exp.main's imports
    # that is not a constant): its start, which tells the run dir Hydra made for a refused command from one that
    # was there before it (made_for_this_command). This process starts now.
    tinker_exp.main.PROCESS_START = time.time()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in imports_set.items():  # as the imports would set them (setdefault)
        os.environ.setdefault(key, value)
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY), (2, request["stderr"], os.O_WRONLY)):
        if fd == 2 and path == request["stdout"]:  # one file for both (stderr=STDOUT): one offset, or each overwrites the other
            os.dup2(1, 2)
            continue
        opened = os.open(path, mode)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)
    if request.get("default_sigint"):  # as a fresh Python whose SIGINT was left at its default (not ignored)
        import signal

        signal.signal(signal.SIGINT, signal.default_int_handler)
    args = request["args"]
    if args[0] == "-m":
        script, module = None, args[1]
        sys.path[0] = request["cwd"]  # `python -m`: the working directory first, not this file's
        sys.argv = ["-m", *args[2:]]  # runpy puts the module's file in argv[0], as `python -m` does
    else:  # `python SCRIPT ARGS`: the script's folder first
        script, module = args[0], None
        sys.path[0] = os.path.dirname(script)
        sys.argv = list(args)
    del request, serve, imports_set, args
    import runpy

    if script:
        run_to_end(lambda: runpy.run_path(script, run_name="__main__"))
    else:
        run_to_end(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))
