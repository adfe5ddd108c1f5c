"""Where pools live and how a run talks to one: a Unix socket in a folder only this user can enter, messages as
length-prefixed pickles (both ends are this user's processes running this checkout's code). Pure Python.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import socket
import struct
import tempfile
from pathlib import Path
from typing import Any

POOL_DIR_ENV = "TINKER_EXP_POOL_DIR"
"""The folder of this user's pools (default: /tmp/tinker_exp-pool-UID); a test session sets its own."""
SWEEP_POOLS_ENV = "TINKER_EXP_SWEEP_POOLS"
"""Set by a sweep for its jobs: the addresses of the sweep's own pools (':'-separated); `backend.pool=auto` takes a
free one of them before this user's pool."""
DEFAULT_NAME = "pool"
"""`python -m tinker_exp.pool up`'s pool: DIR/pool.sock."""
PACKAGES = ("tinker_exp",)
"""The code a pool runs (a sweep's launcher runs in the sweep's own process)."""
_HEADER = struct.Struct("!Q")


def pool_dir() -> Path:
    """This user's pool folder (made by `make_private` when a pool starts)."""
    return Path(os.environ.get(POOL_DIR_ENV) or Path(tempfile.gettempdir()) / f"tinker_exp-pool-{os.getuid()}")


def make_private(folder: Path) -> None:
    """The pools' folder, only this user's (0700): whoever can connect to a pool can run code as this user."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.stat().st_uid != os.getuid() or folder.stat().st_mode & 0o077:
        raise PermissionError(f"{folder}: not a private folder of this user's (chmod 700 it, or set {POOL_DIR_ENV})")


def address_of(name: str = DEFAULT_NAME) -> Path:
    return pool_dir() / f"{name}.sock"


def log_of(address: Path) -> Path:
    """The pool's own log (its start, its groups, its end): beside its socket."""
    return address.with_suffix(".log")


def code_fingerprint() -> str:
    """This checkout's Python code as it is now (each file's path, size and change time): a pool started before a
    change would run the old code, so a run refuses it."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            stat = path.stat()
            digest.update(f"{path.relative_to(root)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
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
    """A connection to the pool at `address` (OSError: none listens there)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(address))
    except BaseException:
        sock.close()
        raise
    return sock


def ask(address: Path, message: Any, timeout_s: float | None = 5.0) -> Any:
    """One request, one reply."""
    with connect(address, timeout_s) as sock:
        send(sock, message)
        return recv(sock)
