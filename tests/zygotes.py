"""Fork servers for the test session: Ray's workers, and the local sweep jobs' drivers, start from a process that
has already imported what they import, instead of importing it afresh each (a verl worker spends about 6 of its 9
CPU-s importing torch, tensordict and transformers; a sweep job's driver about 8 importing torch, verl and Ray).

Each kind of process is started by a command the test session chooses through the environment, never through a
test's own command line:
- a Ray worker: `PY_EXECUTABLE default_worker.py ARGS`, PY_EXECUTABLE being the job's runtime_env `py_executable`
  (Ray's own plugin), which the session sets for every driver it starts through the job config Ray reads from the
  environment (RAY_JOB_CONFIG_JSON_ENV_VAR: :func:`session_env`);
- a local sweep job: `PYTHON -u -m submitit.core._submit FOLDER`, PYTHON being the local launcher's `python`
  (submitit's), whose default is TINKER_EXP_JOB_PYTHON.

That command is this file as a client of the server of its kind (:func:`client`): it hands the server its argv,
environment, working directory and stdin/stdout/stderr (SCM_RIGHTS); the server forks; the child becomes the
process asked for, with those, in a session of its own; the client stays the process its parent started: it passes
signals on to the child and exits as the child did. Ray knows a worker by the pid it registers with (the child's).
Whatever the imports read from the environment is checked: a request whose environment differs there, a job's
driver inside a Slurm job (the Ray daemons it starts must be in the job's process tree, where Slurm finds and ends
them), or one that finds no server, becomes a fresh Python process instead. A Ray worker inside a Slurm job forks:
the server kills a child whose client is gone, so Slurm's end of the job (its SIGKILL of the client) ends it too,
and the tests find it by its environment as they find the job's other processes. (Once turned off, when a
cancelled 2-node job's driver outlived Slurm's grace; it did so as often without it: the cause was an install
without bytecode, reverted.)

Ray's workers are forked from a server that has not imported Ray (nor verl, which imports it): `import ray` reads
Ray's C++ settings from the environment once per process (the worker's job id, its raylet's pid, the auth mode),
and a forked child would keep the server's. A job's driver reads none of those (its job comes from the cluster).

The CLI zygote (tests/cli_zygote.py) serves this protocol's job clients too, with the same loop (`fork_loop`): a
session without a job server of its own (no Ray: `make test-fast`) forks its sweeps' jobs there.

Only with a CPU build of torch (a GPU machine's processes must not inherit a parent that imported CUDA's torch).
Production never sees this file.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys

KINDS = ("ray_worker", "job")
"""A server's socket is named after its kind (the client tells a job's server by it)."""
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The checkout, whose tinker_exp the servers import (the editable install's)."""
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Ray merges this job config's runtime_env into every ray.init's (Ray Jobs sets it for its drivers)."""
JOB_PYTHON_ENV = "TINKER_EXP_JOB_PYTHON"
"""The local launcher's default `python`: the command that starts each sweep job's Python."""
LOG_ENV = "TINKER_EXP_ZYGOTE_LOG"
"""Where the servers log each child (`KIND PID forked|fresh KEYS`), for whoever measures the suite; by default
beside the socket, removed with it."""
FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")
"""What a client passes on to its child: a stop, and submitit's time-limit signal."""


def client_command(socket_path: str) -> str:
    return f"{sys.executable} -S {os.path.abspath(__file__)} {socket_path}"


def session_env(sockets: dict[str, str]) -> dict[str, str]:
    """The environment that sends each kind of process to its server (kind -> socket path)."""
    env = {}
    if "ray_worker" in sockets:
        env[JOB_CONFIG_ENV] = json.dumps({"runtime_env": {"py_executable": client_command(sockets["ray_worker"])}})
    if "job" in sockets:
        env[JOB_PYTHON_ENV] = client_command(sockets["job"])
    return env


def start(kind: str, socket_path: str, env: dict[str, str]):
    """A server, in a session of its own, that ends when the caller does (its stdin closes)."""
    import subprocess

    here = os.path.abspath(__file__)
    return subprocess.Popen(
        [sys.executable, here, "serve", kind, socket_path], stdin=subprocess.PIPE, env=env,
        cwd=os.path.dirname(os.path.dirname(here)), start_new_session=True,
    )  # fmt: skip


# ---------------------------------------------------------------- the client (the process its parent started)


def client(socket_path: str, args: list[str]) -> None:
    import array
    import signal

    def fresh() -> None:
        os.execv(sys.executable, [sys.executable, *args])

    if "SLURM_JOB_ID" in os.environ and os.path.basename(socket_path) == "job":
        fresh()  # a job's driver starts the Ray daemons, which Slurm must find in the job's tree and end
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(socket_path)
    except OSError:  # no server (it ended, or never started)
        fresh()
    ignored = [n for n in range(1, signal.NSIG) if n not in (signal.SIGKILL, signal.SIGSTOP) and _ignored(n)]
    request = json.dumps({"args": args, "env": dict(os.environ), "cwd": os.getcwd(), "ignored": ignored}).encode()
    try:
        conn.sendmsg([struct.pack("!I", len(request)), request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        reader = conn.makefile("r")
        answer = reader.readline()
    except OSError:
        answer = ""
    if not answer:  # the server failed before it forked: stdin, stdout and stderr are still this process's
        fresh()
    pid = json.loads(answer)["pid"]
    for name in FORWARDED_SIGNALS:
        signal.signal(getattr(signal, name), lambda number, frame: os.kill(pid, number))
    line = reader.readline()
    if not line:  # the server is gone
        os._exit(1)
    code = json.loads(line)["rc"]
    if code < 0:  # killed by a signal: so is this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _ignored(signum: int) -> bool:
    import signal

    try:
        return signal.getsignal(signum) == signal.SIG_IGN
    except ValueError:
        return False


# ---------------------------------------------------------------- what each kind imports, and becomes

RAY_WORKER_PRELOAD = (
    "torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.distributed.tensor",
    "tensordict", "transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2", "peft", "safetensors.torch",
)  # fmt: skip
"""What a CPU worker imports that imports no Ray (about 6 of its 8 CPU-s of imports)."""

APPLIED_IN_THE_CHILD = ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE")
"""Start-up variables that change nothing the imports did: a forked worker sets sys.dont_write_bytecode itself, and
its streams are the child's own (block-buffered, as they were). A warm pool's workers have neither (a pool passes its
runs' environment on, not these) where the suite's processes may: they forked fresh for that alone."""

RAY_WORKER_UNSAFE_ENV = ("HF_", "TRANSFORMERS", "PYTHON", "OPENBLAS", "MKL", "NUMPY", "TORCH", "PYTORCH", "TENSORDICT", "KMP_", "GOMP")
"""Variables those imports read. OMP_NUM_THREADS, which Ray sets per worker, is applied with torch.set_num_threads."""


def preload(kind: str) -> dict[str, str]:
    """Import what `kind` imports first; returns the variables the imports set (setdefault), which the environment is
    cleared of again and a child gets back unless its own has them."""
    import contextlib
    import importlib

    if kind == "job":
        sys.path.insert(0, REPO)  # hydra_plugins
        import cli_zygote

        import tinker_exp.main  # noqa: F401

        imports_set = cli_zygote.preload()
        with contextlib.redirect_stdout(sys.stderr):
            import submitit.core._submit  # noqa: F401

            import hydra_plugins.tinker_exp_plugins.launchers  # noqa: F401
        del sys.path[0]
        return imports_set
    before = dict(os.environ)
    with contextlib.redirect_stdout(sys.stderr):
        for name in RAY_WORKER_PRELOAD:
            importlib.import_module(name)
    if "ray" in sys.modules:
        raise RuntimeError("a preloaded module imported Ray")
    added = {key: value for key, value in os.environ.items() if key not in before}
    os.environ.clear()
    os.environ.update(before)
    return added


def differs(kind: str, env: dict[str, str], imports_set: dict[str, str]) -> list[str]:
    """The variables the imports read whose value in `env` is not the one they saw here."""
    from helpers import ZYGOTE_SAFE_ENV, ZYGOTE_UNSAFE_ENV

    if kind == "job":
        from tinker_exp.runtime.workers import platform_env

        unsafe, safe = ZYGOTE_UNSAFE_ENV, {*ZYGOTE_SAFE_ENV, JOB_CONFIG_ENV}
        seen = {**platform_env("cpu"), **imports_set}  # the imports ran with the first and set the second
    else:  # PYTHONBREAKPOINT: Ray sets it; read at breakpoint()
        unsafe, safe = RAY_WORKER_UNSAFE_ENV, {*ZYGOTE_SAFE_ENV, "PYTHONBREAKPOINT", *APPLIED_IN_THE_CHILD}
        seen = imports_set
    keys = {key for key in (*env, *os.environ, *seen) if key.startswith(unsafe) and key not in safe}
    if set(python_path(env)) <= {REPO} and not os.environ.get("PYTHONPATH"):  # the checkout: put on sys.path
        keys.discard("PYTHONPATH")  # (the benchmarks set it; what the imports found there is what they found)
    # A variable the imports set or were given is theirs unless `env` has another value for them to read.
    return sorted(key for key in keys if env.get(key, seen.get(key)) != seen.get(key, os.environ.get(key)))


def python_path(env: dict[str, str]) -> list[str]:
    """PYTHONPATH's folders, as Python puts them on sys.path."""
    return [os.path.abspath(entry) for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]


def become(kind: str, request: dict, imports_set: dict[str, str]) -> None:
    """In the forked child: the process asked for, with the client's environment, directory and stdio."""
    os.setsid()  # what kills a process group (Ray does, to a worker's) must not reach the server's
    fresh = differs(kind, request["env"], imports_set)
    with open(request["log"], "a") as log:  # for whoever measures the suite: which were forked
        log.write(f"{kind} {os.getpid()} {'fresh ' + ','.join(fresh) if fresh else 'forked'}\n")
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for target, fd in zip((0, 1, 2), request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    import signal

    for signum in request["ignored"]:  # inherited as an exec inherits them (Ray's daemons ignore Slurm's USR1/USR2)
        signal.signal(signum, signal.SIG_IGN)
    args = request["args"]
    if kind == "job" and args[:2] != ["-u", "-m"]:
        fresh = ["its command"]
    if fresh:  # this environment (or command) would have imported them otherwise
        os.execv(sys.executable, [sys.executable, *args])
    for key, value in imports_set.items():  # as the imports would have set them
        os.environ.setdefault(key, value)
    sys.stdin = open(0, closefd=False)
    unbuffered = kind == "job"  # its command's -u (a worker's streams stay as they were before PYTHONUNBUFFERED was safe)
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    sys.stdout, sys.stderr = _stream(1, unbuffered), _stream(2, unbuffered)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:  # OpenMP read it when torch was imported here
        import torch

        torch.set_num_threads(int(threads))
    from cli_zygote import run_to_end  # this file's folder is sys.path[0] until main() runs

    def main() -> None:
        import runpy

        if kind == "job":
            import time

            import tinker_exp.main

            tinker_exp.main.PROCESS_START = time.time()  # as cli_zygote: this process starts now
            module, *rest = args[2:]
            sys.argv = ["-m", *rest]
            sys.path[0] = request["cwd"]  # `python -m`: the working directory first
            sys.path[1:1] = python_path(request["env"])
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script, *rest = args
            sys.argv = [script, *rest]
            sys.path[0] = os.path.dirname(script)
            sys.path[1:1] = python_path(request["env"])
            runpy.run_path(script, run_name="__main__")

    run_to_end(main)


def _stream(fd: int, unbuffered: bool):
    import io

    raw = io.FileIO(fd, "w", closefd=False)
    if unbuffered:
        return io.TextIOWrapper(raw, write_through=True, line_buffering=False)
    return io.TextIOWrapper(io.BufferedWriter(raw), line_buffering=fd == 2 or os.isatty(fd))  # as Python's own


# ---------------------------------------------------------------- the server


def serve(kind: str, socket_path: str) -> tuple[dict, dict[str, str]]:
    """Accept requests until stdin closes (the test process is gone); returns, in a forked child only, the request
    it is to run and what the imports set."""
    import gc

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)  # clients that come during preload wait in the backlog
    imports_set = preload(kind)
    gc.freeze()  # the children's collections leave the imported objects alone: no copy of the pages they are on
    log = os.environ.get(LOG_ENV) or socket_path + ".log"
    _, request = fork_loop({kind: listener}, {kind: lambda conn: {**receive(conn), "log": log}})
    return request, imports_set


def fork_loop(listeners: dict[str, socket.socket], read_request: dict) -> tuple[str, dict]:
    """Fork a child for each request on `listeners` (kind -> a listening socket) until stdin closes; returns, in a
    forked child only, the kind and the request it is to run. `read_request[kind](conn)` reads one from a client's
    connection (OSError, ValueError or struct.error: the client went before it asked); the descriptors it received
    ("fds") are the child's. Each client is answered on its connection {"pid"} once forked and {"rc"} once its child
    has ended; a connection closed first (its client killed) kills the child. Children run side by side."""
    import contextlib
    import selectors
    import signal

    wake_r, wake_w = os.pipe()  # SIGCHLD wakes the loop (the handler does nothing; the wakeup fd is written)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    for kind, listener in listeners.items():
        selector.register(listener, selectors.EVENT_READ, kind)
    children: dict[int, socket.socket] = {}  # pid -> its client's connection
    while True:
        for key, _ in selector.select():
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    os._exit(0)  # what runs goes on (its test ends it)
            elif key.data == "child":
                os.read(wake_r, 4096)
                while children:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    conn = children.pop(pid)
                    with contextlib.suppress(OSError):
                        conn.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                    with contextlib.suppress(KeyError):  # not if its client closed it first
                        selector.unregister(conn)
                    conn.close()
            elif key.data in listeners:
                conn, _ = listeners[key.data].accept()
                try:
                    request = read_request[key.data](conn)
                except (OSError, ValueError, struct.error):  # a client gone before it asked: nothing to start
                    conn.close()
                    continue
                sys.stdout.flush(), sys.stderr.flush()  # nothing buffered is written twice
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for other in [conn, *listeners.values(), *children.values()]:
                        other.close()
                    selector.close()
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    return key.data, request
                for fd in request.get("fds", ()):
                    os.close(fd)
                with contextlib.suppress(OSError):  # its client gone: the read below finds it closed
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            else:  # a client closed its end (killed): its child goes too
                with contextlib.suppress(OSError):
                    if key.fileobj.recv(1):
                        continue
                selector.unregister(key.fileobj)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(key.data, signal.SIGKILL)


def receive(conn: socket.socket) -> dict:
    """A client's request: its JSON (argv, env, cwd) and its stdin, stdout and stderr (received fds)."""
    import array

    fds = array.array("i")
    header, ancillary, _, _ = conn.recvmsg(4, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"{len(fds)} file descriptors, not 3")
    size = struct.unpack("!I", header)[0]
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("request cut short")
        body += chunk
    return {**json.loads(body), "fds": list(fds)}


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "serve":
        kind = sys.argv[2]
        become(kind, *serve(kind, sys.argv[3]))
    else:
        client(sys.argv[1], sys.argv[2:])
