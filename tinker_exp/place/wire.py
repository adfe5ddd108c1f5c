"""Where pools live and how a run talks to one: a Unix socket in a private folder, messages as length-prefixed pickles.

The socket lives in a folder only this user can enter. Both ends are this user's processes running this checkout's code,
and a client checks it before it sends or reads anything (`connect`): the folder is this user's and private (0700), the
socket too, and the process listening on it runs as this user (SO_PEERCRED). Pure Python.
"""

from __future__ import annotations

import hashlib
import os
import stat
import pickle
import socket
import struct
import tempfile
from pathlib import Path
from typing import Any

from tinker_exp.errors import TinkerExpError

POOL_DIR_ENV = "TINKER_EXP_POOL_DIR"
"""The folder of this user's pools (default: /tmp/tinker_exp-pool-UID); a test session sets its own."""
SWEEP_POOLS_ENV = "TINKER_EXP_SWEEP_POOLS"
"""Set by a sweep for its jobs: the addresses of the sweep's own pools (':'-separated); `backend.pool=auto` takes a
free one of them before this user's pool."""
DEFAULT_NAME = "pool"
"""`python -m tinker_exp.pool up`'s pool: DIR/pool.sock."""
PACKAGES = ("tinker_exp", "hydra_plugins")
"""The code a pool runs (a sweep's launcher runs in the sweep's own process; its sweepers compose the configs)."""
LIBRARIES = ("verl", "torch", "transformers", "ray")
"""Installed packages whose versions a pool's code fingerprint holds: one upgraded since the pool started is not
the one it imported."""
WORKER_ENV_PREFIXES = ("CUDA_", "NCCL_", "PYTORCH_", "TORCH_", "OMP_", "MKL_", "GLOO_", "HIP_", "ROCR_", "HSA_",
                       "NVIDIA_", "CUBLAS_", "CUDNN_", "TRITON_", "VERL_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_",
                       "TOKENIZERS_")  # fmt: skip
"""Environment variables that reach the workers (Ray's processes take the environment the pool's cluster started
with): part of a group's key, so a run with other values gets a group (and cluster) of its own."""
RUN_ENV_PREFIXES = ("LC_", "XDG_", "TINKER_EXP_", "WANDB_")
RUN_ENV_NAMES = ("HOME", "USER", "LOGNAME", "PATH", "LANG", "TZ", "TMPDIR", "TERM", "COLUMNS", "NO_COLOR", "PYTHONHASHSEED")
"""With WORKER_ENV_PREFIXES: the environment a run sends its pool (docs/pool.md); nothing else of the client's."""
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL", "AUTH")
"""A variable whose name holds one of these is sent only when the run needs it (`sent_environment`)."""
_HEADER = struct.Struct("!Q")


def is_secret(name: str) -> bool:
    return any(word in name.upper() for word in SECRET_WORDS)


def sent_environment(environ: dict[str, str], needed_secrets: tuple[str, ...] = ()) -> dict[str, str]:
    """What of `environ` a run sends its pool: the names above, no secret but those in `needed_secrets`."""
    prefixes = WORKER_ENV_PREFIXES + RUN_ENV_PREFIXES
    return {
        name: value for name, value in environ.items()
        if (name in RUN_ENV_NAMES or name.startswith(prefixes)) and (not is_secret(name) or name in needed_secrets)
    }  # fmt: skip


def worker_environment(environ: dict[str, str]) -> dict[str, str]:
    """The part of a run's environment that reaches the workers (no secret: it is shown when it differs)."""
    return {name: value for name, value in sorted(environ.items()) if name.startswith(WORKER_ENV_PREFIXES) and not is_secret(name)}


def pool_dir() -> Path:
    """This user's pool folder (made by `make_private` when a pool starts)."""
    return Path(os.environ.get(POOL_DIR_ENV) or Path(tempfile.gettempdir()) / f"tinker_exp-pool-{os.getuid()}")


class UntrustedPool(TinkerExpError):
    """A pool's folder or socket that is not this user's alone, or a peer running as another user.

    Nothing is sent to it or read from it."""

    exit_code = 2
    label = "pool refused"


def make_private(folder: Path) -> None:
    """The pools' folder, only this user's (0700): whoever can connect to a pool can run code as this user."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        pass  # a file there: private_folder_problem says so
    except OSError as e:
        raise UntrustedPool(f"{folder}: cannot make the pools' folder ({e.strerror}); set {POOL_DIR_ENV} to a folder of yours") from None
    problem = private_folder_problem(folder)
    if problem:
        raise UntrustedPool(problem)


def private_folder_problem(folder: Path) -> str | None:
    """Why `folder` is not a private folder of this user's (None: it is).

    Not a folder, another owner, or a mode that lets others in. lstat: a symlink planted in its place is not
    followed."""
    try:
        info = folder.lstat()
    except FileNotFoundError:
        return f"{folder}: no such folder"
    except OSError as e:
        return f"{folder}: {e.strerror}"
    fix = f"(set {POOL_DIR_ENV} to a folder of yours, or remove it)"
    if not stat.S_ISDIR(info.st_mode):
        return f"{folder}: not a folder {fix}"
    if info.st_uid != os.getuid():
        return f"{folder}: owned by uid {info.st_uid}, not by you (uid {os.getuid()}) {fix}"
    if info.st_mode & 0o077:
        return f"{folder}: mode {stat.S_IMODE(info.st_mode):04o}, not private to you (chmod 700 it) {fix}"
    return None


def socket_problem(address: Path) -> str | None:
    """Why the socket at `address` is not to be trusted, before connecting.

    Its folder is not this user's private folder, or the socket is another user's. None: nothing to say (no folder or no
    socket there: the connect's error, no pool)."""
    if not os.path.lexists(address.parent):
        return None
    problem = private_folder_problem(address.parent)
    if problem:
        return problem
    try:
        info = address.lstat()
    except OSError:
        return None
    if info.st_uid != os.getuid():
        return f"{address}: owned by uid {info.st_uid}, not by you (uid {os.getuid()})"
    return None


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED).

    None where the system has no such option (then the private folder alone guards the socket)."""
    try:
        credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (AttributeError, OSError):
        return None
    return struct.unpack("3i", credentials)[1]


def address_of(name: str = DEFAULT_NAME) -> Path:
    return pool_dir() / f"{name}.sock"


ALREADY_EXIT = 3
"""The exit status of a pool process that found another one holding its address (two `up` at once): the other
one serves."""


def lock_of(address: Path) -> Path:
    """The file a pool process holds (flock) while it lives, its pid in it: one process an address."""
    return address.with_suffix(".lock")


def hold_address(address: Path) -> Any:
    """The address's lock, held by this process, its pid written in; None when another process holds it.

    The lock is an open file: closing it or ending lets go."""
    import fcntl

    file = open(lock_of(address), "a+")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.close()
        return None
    file.truncate(0)
    file.write(f"{os.getpid()}\n")
    file.flush()
    return file


def pid_holding(address: Path) -> int | None:
    """The pid of the pool process that holds `address` (listening or still starting), None if none does."""
    import fcntl

    try:
        file = open(lock_of(address))
    except OSError:
        return None
    with file:
        try:
            fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: its pid is in it
            text = file.read().strip()
            return int(text) if text.isdigit() else None
        return None


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet waited for, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def log_of(address: Path) -> Path:
    """The pool's own log (its start, its groups, its end): beside its socket."""
    return address.with_suffix(".log")


def workers_dir_of(address: Path) -> Path:
    """Where the pool's own groups print (built ahead by `up`, or for its runs on slots, which share them)."""
    return log_of(address).parent / f"{address.stem}-workers"

def code_fingerprint() -> str:
    """This checkout's Python code as it is now and the installed versions of LIBRARIES.

    Each file's path, size and change time. A pool started before a change would run the old code, so a run refuses
    it."""
    from importlib.metadata import PackageNotFoundError, version

    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            info = path.stat()
            digest.update(f"{path.relative_to(root)}:{info.st_size}:{info.st_mtime_ns}\n".encode())
    for library in LIBRARIES:
        try:
            digest.update(f"{library}=={version(library)}\n".encode())
        except PackageNotFoundError:
            digest.update(f"{library} absent\n".encode())
    return digest.hexdigest()[:16]


def send(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv(sock: socket.socket) -> Any:
    """The next message; EOFError when the other end has gone."""
    (size,) = _HEADER.unpack(_exactly(sock, _HEADER.size))
    return pickle.loads(_exactly(sock, size))


def _exactly(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = sock.recv(min(left, 1 << 20))
        if not part:
            raise EOFError("the other end closed the connection")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def connect(address: Path, timeout_s: float | None = 5.0) -> socket.socket:
    """A connection to the pool at `address`, checked before anything is sent or read.

    UntrustedPool when the folder or socket is not this user's alone or the listening process runs as another user;
    OSError: none listens there."""
    problem = socket_problem(address)
    if problem:
        raise UntrustedPool(problem)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(address))
        uid = peer_uid(sock)
        if uid is not None and uid != os.getuid():
            raise UntrustedPool(f"{address}: the process listening there runs as uid {uid}, not as you (uid {os.getuid()})")
    except BaseException:
        sock.close()
        raise
    return sock


WAITING_MARGIN_S = 30.0
"""How much longer than the wait a pool announces a client waits for its answer (a loaded machine's slack)."""


def lease_answer(sock: socket.socket) -> Any:
    """The pool's answer to a lease, read past any "waiting" message it sends first.

    That message is ("waiting", {"for": what, "bound_s": seconds or None}). The pool answers at once unless a run before
    is still ending (killed or stopped: it closes its files) or, for a sweep's trial, every slot is held by its sweep;
    then it says so and the client waits for as long as the pool may (plus a margin), not just the connection's timeout
    (a run that waited only those 5 s would take the pool for gone and start cold)."""
    answer = recv(sock)
    while answer[0] == "waiting":
        bound = answer[1].get("bound_s")
        sock.settimeout(None if bound is None else bound + WAITING_MARGIN_S)
        answer = recv(sock)
    return answer


def ask(address: Path, message: Any, timeout_s: float | None = 5.0) -> Any:
    """One request, one reply."""
    with connect(address, timeout_s) as sock:
        send(sock, message)
        return recv(sock)
