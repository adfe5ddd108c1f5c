"""Ray's worker processes for the test session without each importing torch, verl and Ray afresh (about 9 CPU-s
of a verl worker's 10 on this machine kind; a 2-worker run is 40 CPU-s in all).

Ray starts a Python worker as `PY_EXECUTABLE default_worker.py ARGS`, where PY_EXECUTABLE is the job's
runtime_env `py_executable` (Ray's own plugin). The test session sets that, for every driver it starts, through the
job config Ray reads from the environment (RAY_JOB_CONFIG_JSON_ENV_VAR; :func:`job_config_env`): PY_EXECUTABLE is
this file as a client of a server that has imported what a CPU worker imports (:func:`preload`). The client hands
the server its argv, environment, working directory and stdin/stdout/stderr (SCM_RIGHTS); the server forks; the
child becomes `python default_worker.py ARGS` with those (and the thread count Ray gave it), and the client stays
what Ray started: it passes SIGTERM/SIGINT on to the child and exits as the child did. Ray knows the worker by the
pid it registers with (the child's), and kills that one. A client that finds no server execs a plain Python worker.

Only with a CPU build of torch (a GPU machine's workers must not inherit a parent that imported CUDA's torch), and
only for drivers that inherit the session's environment: production never sees this file.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys

ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Ray merges this job config's runtime_env into every ray.init's (Ray Jobs sets it for its drivers)."""
MAX_MESSAGE = 1 << 20


def job_config_env(socket_path: str) -> str:
    command = f"{sys.executable} -S {os.path.abspath(__file__)} {socket_path}"
    return json.dumps({"runtime_env": {"py_executable": command}})


# ---------------------------------------------------------------- the client (Ray's worker process, as Ray sees it)


def client(socket_path: str, args: list[str]) -> None:
    import array
    import signal

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(socket_path)
    except OSError:  # no server (it ended, or never started): the worker Ray would have started
        python = sys.executable
        os.execv(python, [python, *args])
    request = json.dumps({"args": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    fds = array.array("i", [0, 1, 2])
    conn.sendmsg([struct.pack("!I", len(request)), request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    reader = conn.makefile("r")
    answer = reader.readline()
    if not answer:  # the server failed before it forked: the fds are still this process's
        os.execv(sys.executable, [sys.executable, *args])
    pid = json.loads(answer)["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda number, frame: os.kill(pid, number))
    line = reader.readline()
    if not line:  # the server is gone: its child with it, or not; this process ends either way
        os._exit(1)
    code = json.loads(line)["rc"]
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


# ---------------------------------------------------------------- the server


PRELOADED = (
    "torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.distributed.tensor",
    "tensordict", "transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2", "peft", "safetensors.torch",
)  # fmt: skip
"""What a CPU worker imports that imports no Ray (about 6 of its 8 CPU-s of imports). Not Ray, nor verl (which
imports Ray): `import ray` builds Ray's C++ settings from the environment once for the process (the worker's job
id, its raylet's pid, the auth mode), and a forked child would keep this process's."""

UNSAFE_ENV = ("HF_", "TRANSFORMERS", "PYTHON", "OPENBLAS", "MKL", "NUMPY", "TORCH", "PYTORCH", "CUDA", "TENSORDICT", "KMP_", "GOMP")
"""Variables those imports read: a worker whose environment has other values than the server's becomes a fresh
Python process (OMP_NUM_THREADS, which Ray sets per worker, is applied with torch.set_num_threads instead)."""


def preload() -> dict[str, str]:
    """Import PRELOADED; returns the variables the imports set (setdefault), which the environment is cleared of
    again and a worker gets back unless its own has them."""
    import contextlib
    import importlib

    before = dict(os.environ)
    with contextlib.redirect_stdout(sys.stderr):
        for name in PRELOADED:
            importlib.import_module(name)
    if "ray" in sys.modules:
        raise RuntimeError("a preloaded module imported Ray")
    added = {key: value for key, value in os.environ.items() if key not in before}
    os.environ.clear()
    os.environ.update(before)
    return added


def differs(env: dict[str, str], imports_set: dict[str, str]) -> list[str]:
    """The variables of UNSAFE_ENV whose value in `env` is not the one the imports here saw."""
    seen = {**os.environ, **imports_set}
    keys = {key for key in (*env, *seen) if key.startswith(UNSAFE_ENV)}
    return sorted(key for key in keys if env.get(key) != seen.get(key) and not (key in imports_set and key in env))


def serve(socket_path: str) -> tuple[socket.socket, dict, dict[str, str]]:
    """Accept requests until stdin closes (the test process is gone); returns, in a forked child only, the
    connection and the request it is to run."""
    import contextlib
    import gc
    import selectors
    import signal

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)  # clients that come during preload wait in the backlog
    imports_set = preload()
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select():
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    os._exit(0)
            elif key.data == "child":
                os.read(wake_r, 4096)
                while children:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    conn = children.pop(pid, None)
                    if conn is not None:
                        try:
                            conn.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                        except OSError:
                            pass
                        with contextlib.suppress(KeyError):  # not if its client closed it first
                            selector.unregister(conn)
                        conn.close()
            elif key.data == "accept":
                conn, _ = listener.accept()
                try:
                    request = {**receive(conn), "log": socket_path + ".log"}
                except (OSError, ValueError, struct.error):  # a client gone before it asked: nothing to start
                    conn.close()
                    continue
                sys.stdout.flush(), sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    selector.close()
                    listener.close()
                    for other in children.values():
                        other.close()
                    return conn, request, imports_set
                for fd in request["fds"]:
                    os.close(fd)
                try:
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                except OSError:
                    pass  # its client is gone: the read below finds it closed and kills the child
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            else:  # a client closed its end (killed): its worker goes too
                pid = key.data
                try:
                    closed = not key.fileobj.recv(1)
                except OSError:
                    closed = True
                if closed:
                    selector.unregister(key.fileobj)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


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


def become_worker(conn: socket.socket, request: dict, imports_set: dict[str, str]) -> None:
    """In the forked child: `python default_worker.py ARGS` with the client's environment, directory and stdio."""
    conn.close()
    os.setsid()  # what Ray does to a worker's process group (kill it whole) must not reach the server's
    fresh = differs(request["env"], imports_set)
    with open(request["log"], "a") as log:  # for whoever measures the suite: which workers were forked
        log.write(f"{os.getpid()} {'fresh ' + ','.join(fresh) if fresh else 'forked'}\n")
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for target, fd in zip((0, 1, 2), request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    script, *rest = request["args"]
    if fresh:  # this environment would have imported them otherwise
        os.execv(sys.executable, [sys.executable, script, *rest])
    for key, value in imports_set.items():  # as the imports would have set them
        os.environ.setdefault(key, value)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:  # OpenMP read it when torch was imported here
        import torch

        torch.set_num_threads(int(threads))
    from cli_zygote import end, exit_status  # this file's folder is sys.path[0] until the next line

    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(script)
    import runpy

    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        end(exit_status(stop))
    except KeyboardInterrupt:
        end(None)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        end(1)
    end(0)


def start(socket_path: str, env: dict[str, str]):
    """The server, in a process of its own that ends when the caller does (its stdin closes)."""
    import subprocess

    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "serve", socket_path], stdin=subprocess.PIPE, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), start_new_session=True,
    )  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "serve":
        become_worker(*serve(sys.argv[2]))
    else:
        client(sys.argv[1], sys.argv[2:])
