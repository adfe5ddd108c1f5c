"""`python -m tinker_exp` without paying Python's start-up and the CLI's own imports for every call (helpers.run_cli).

Run as a script, it imports what `tinker_exp/__main__.py` imports first (tinker_exp.main: Hydra, OmegaConf, our
config; one thread, nothing started), then reads requests, one JSON line each on stdin: {"args", "env", "cwd",
"stdout", "stderr"}. For each it forks; the parent answers {"pid"} at once and {"rc"} when the child has ended; the
child leaves the loop and becomes `python -m tinker_exp ARGS` in that cwd and environment, its stdin /dev/null and its
stdout/stderr those files, and ends as that process would (atexit handlers, exit status, a traceback on an uncaught
exception). Everything the CLI imports after tinker_exp.main (torch, verl, Ray, W&B) it imports itself, so what it
prints and does is a fresh process's; the one import-time value of tinker_exp.main that is not a constant, the
process's start (PROCESS_START), is set again in the child. helpers.run_cli falls back to a fresh process for an environment that changes
what these imports read (helpers.ZYGOTE_UNSAFE_ENV).
"""

from __future__ import annotations

import json
import os
import sys


def serve() -> dict:
    """The zygote's loop; returns (in a forked child only) the request that child is to run."""
    import tinker_exp.main  # noqa: F401  what every CLI call imports first

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush(), sys.stderr.flush()  # nothing buffered is written twice
        pid = os.fork()
        if pid == 0:
            return request
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    request = serve()
    import time

    import tinker_exp.main

    # What a fresh process sets as it imports the entry (the only module-level state of tinker_exp.main's imports
    # that is not a constant): its start, which tells the run dir Hydra made for a refused command from one that
    # was there before it (made_for_this_command). This process starts now.
    tinker_exp.main.PROCESS_START = time.time()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY), (2, request["stderr"], os.O_WRONLY)):
        opened = os.open(path, mode)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)
    sys.path[0] = request["cwd"]  # `python -m`: the working directory first, not this file's
    sys.argv = ["-m", *request["args"]]  # runpy puts the module's file in argv[0], as `python -m` does
    del request, serve
    import runpy

    runpy.run_module("tinker_exp", run_name="__main__", alter_sys=True)
