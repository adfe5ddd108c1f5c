"""`python -m tinker_exp.pool up|status|down`: warm workers that runs reuse (docs/pool.md).

  up [--idle-min N] [OVERRIDES...]   start this user's pool (or keep the one that is up) with a worker group built
                                     for runs like `python -m tinker_exp OVERRIDES`; returns once it is ready
  status                             what the pool holds, its memory, since when, what runs on it now
  down                               free its workers and end it
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from tinker_exp.errors import STOPS, ConfigError, one_line, suggest
from tinker_exp.formats import masked
from tinker_exp.pool import wire
from tinker_exp.pool.local import answers, end, start_host

IDLE_MIN = 60.0
"""A pool with no run for this long frees its workers and ends (`up --idle-min`)."""
USAGE = __doc__.split("\n\n", 1)[1]


COMMANDS = ("up", "status", "down")


def main(argv: list[str]) -> int:
    try:
        return command(argv)
    except BrokenPipeError:  # `pool status | head`: the reader has gone; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's own flush at exit would fail too)
        return 0


def command(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m tinker_exp.pool up|status|down\n\n{USAGE}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the pool's lines as a run shows them
    try:
        if name == "up":
            return up(rest)
        if name == "status":
            return status(wire.address_of())
        if name == "down":
            return down(wire.address_of())
        if name == "_host":  # the pool's own process, started by `up` or a sweep
            from tinker_exp.pool.host import serve

            serve(Path(rest[0]), float(rest[1]), int(rest[2]) if len(rest) > 2 else None)
            return 0
        raise ConfigError(f"{name}: not a pool command" + suggest(name, COMMANDS, "its commands:"))
    except STOPS as e:
        print(f"tinker_exp: {one_line(e)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("tinker_exp: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def idle_minutes(args: list[str]) -> tuple[float, list[str]]:
    """--idle-min N (or --idle-min=N) out of `args`; the rest are a run's overrides."""
    idle, rest, items = IDLE_MIN, [], iter(args)
    for arg in items:
        if arg == "--idle-min" or arg.startswith("--idle-min="):
            value = arg.partition("=")[2] or next(items, "")
            try:
                idle = float(value)
            except ValueError:
                raise ConfigError(f"--idle-min={value}: not a number of minutes") from None
            if not idle > 0:
                raise ConfigError(f"--idle-min={value}: must be > 0")
        else:
            rest.append(arg)
    return idle, rest


def up(args: list[str]) -> int:
    """Check the overrides as a run would (nothing started on a mistake), start the pool if none answers, and have
    it build the group for runs like these. Another `up` building at the same time is waited for (its pool serves)."""
    from tinker_exp.pool.client import Lease, run_payload
    from tinker_exp.pool.local import START_TIMEOUT_S

    idle, overrides = idle_minutes(args)
    cfg = checked_config(overrides)
    address = wire.address_of()
    wire.make_private(address.parent)  # one line when the folder is not this user's alone
    started, restarts, deadline = None, 0, time.monotonic() + START_TIMEOUT_S
    while True:
        was_up = answers(address)
        if not was_up:
            started = start_host(address, idle * 60)
            if started.returncode == wire.ALREADY_EXIT:  # another `up`'s pool serves: not this one's to end
                started = None
        sock = wire.connect(address, None)
        wire.send(sock, ("prepare", {"code": wire.code_fingerprint(), "pid": os.getpid(), "who": "pool up", **run_payload((cfg,), cfg)}))
        reply = wire.recv(sock)
        if reply[0] == "stale" and restarts == 0:
            sock.close()
            print(f"pool: the pool at {address} runs the code of before a change: ending it, starting another")
            down(address)
            restarts += 1
        elif reply[0] == "busy" and reply[1]["who"] == "pool up" and time.monotonic() < deadline:
            sock.close()
            time.sleep(1.0)  # another `up` builds its group
        else:
            break
    if reply[0] == "busy":
        raise ConfigError(f"the pool at {address} is running a run ({masked(reply[1]['who'])}); up again when it ends")
    lease = Lease(sock, address, reply[1])
    try:
        described = lease.follow()
    except BaseException:
        if started is not None:  # a pool this `up` started and could not build: not left behind half made
            end(address, started)
        raise
    finally:
        lease.release()
    state = "up" if started is not None or not was_up else "already up"
    print(f"pool {state} at {address} (pid {reply[1]['pid']}): {described}; runs train on it (backend.pool=auto, the default); "
          f"it idles out after {idle:g} min without a run; python -m tinker_exp.pool down frees it")  # fmt: skip
    return 0


def checked_config(overrides: list[str]):
    """The typed config of `python -m tinker_exp OVERRIDES`, checked (its plan too) as a run checks it."""
    from hydra import compose, initialize_config_dir

    from tinker_exp import config
    from tinker_exp.config import CONF_DIR
    from tinker_exp.config.compose_errors import one_line_compose_errors
    from tinker_exp.run import validate

    config.register()
    with one_line_compose_errors(), initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        dcfg = compose(config_name="config", overrides=overrides)
    cfg = config.load(dcfg)
    validate(cfg)
    return cfg


def status(address: Path) -> int:
    try:
        info = wire.ask(address, ("status",))
    except (OSError, EOFError):
        print(f"no pool is up at {address} (python -m tinker_exp.pool up starts one)")
        return 0
    print(describe_status(info))
    return 0


def describe_status(info: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
    memory = info["memory_mb"]
    workers = ", ".join(f"{mb or 0:.0f} (pid {pid})" for mb, pid in zip(memory["workers"], info["worker_pids"])) or "-"
    holder = info["holder"]
    now = (
        f"running a run since {time.strftime('%H:%M:%S', time.localtime(holder['since']))} (pid {holder['pid']}: {masked(holder['who']) or 'no overrides'})"
        if holder else f"idle for {info['idle_for_s'] / 60:.1f} min (ends after {info['idle_s'] / 60:g} min idle)"
    )  # fmt: skip
    return "\n".join([
        f"pool at {info['address']}: pid {info['pid']}, up since {since}",
        f"  workers: {info['group'] or 'none yet (the next run builds them)'}",
        f"  runs served: {info['runs']}; now {now}",
        f"  memory (resident, MiB): pool {memory['pool'] or 0:.0f}; workers {workers}",
    ])  # fmt: skip


def down(address: Path) -> int:
    pid = end(address)
    if pid is None:
        print(f"no pool is up at {address}")
    else:
        print(f"pool down (pid {pid})" if not wire.alive(pid) else f"pool (pid {pid}) still ending")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
