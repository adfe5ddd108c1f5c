"""`python -m tinker_exp.pool up|status|down`: warm workers that runs reuse (docs/pool.md).

  up [--idle-min N] [--max-groups N] [--memory-mb N] [--slots N] [OVERRIDES...]
                                     start this user's pool (or keep the one that is up) with a worker group built
                                     for runs like `python -m tinker_exp OVERRIDES`; returns once it is ready.
                                     --max-groups (default 4) and --memory-mb (default: half the memory available
                                     at its start) bound the groups it keeps (the least recently used freed first);
                                     --slots (default 4): LoRA SFT runs it trains at once, each on a slot of one
                                     group (1: one run at a time)
  status                             what the pool holds (each group), its memory, since when, what runs on it now
  down                               free its workers and end it
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tinker_exp.errors import STOPS, ConfigError, one_line, suggest
from tinker_exp.formats import masked
from tinker_exp.place import wire
from tinker_exp.pool.host import SLOTS
from tinker_exp.place.pools import answers, end, start_host

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
    if not argv or "-h" in argv or "--help" in argv:  # `pool up --help` too: not a mistyped flag
        print(f"usage: python -m tinker_exp.pool up|status|down\n\n{USAGE}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    terminal = logging.StreamHandler()
    terminal.setFormatter(logging.Formatter("%(message)s"))  # the pool's lines as a run shows them
    if name != "_host":  # the pool's own process logs every record into pool.log
        terminal.addFilter(ours_or_a_warning)
    logging.basicConfig(level=logging.INFO, handlers=[terminal])
    try:
        if name == "up":
            return up(rest)
        if name == "status":
            no_arguments(name, rest)
            return status(wire.address_of())
        if name == "down":
            no_arguments(name, rest)
            return down(wire.address_of())
        if name == "_host":  # the pool's own process, started by `up` or a sweep
            from tinker_exp.pool.host import serve

            address, idle_s, parent, max_groups, memory_mb, *slots = rest  # no slots: a sweep's pool, one run at a time
            serve(Path(address), float(idle_s), int(parent) or None, int(max_groups) or None, float(memory_mb) or None,
                  int(slots[0]) if slots else 1)  # fmt: skip
            return 0
        raise ConfigError(f"{name}: not a pool command" + suggest(name, COMMANDS, "its commands:"))
    except STOPS as e:
        print(f"tinker_exp: {one_line(e)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("tinker_exp: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def ours_or_a_warning(record: logging.LogRecord) -> bool:
    """What `up`, `status` and `down` print: tinker_exp's own lines, and a library's warnings and errors.

    A library's info (verl's "Platform override from VERL_PLATFORM: cpu" as the pool builds a group) is left out, as a
    run's terminal leaves it to the run's log (conf/hydra/job_logging/tinker_exp.yaml)."""
    return record.name.partition(".")[0] == "tinker_exp" or record.levelno >= logging.WARNING


@dataclass(frozen=True)
class UpOptions:
    """`up`'s own options (the rest of its arguments are a run's overrides)."""

    idle_min: float = IDLE_MIN
    """--idle-min: a pool with no run for this long frees its workers and ends."""
    max_groups: int | None = None
    """--max-groups: how many worker groups it keeps at most (None: runtime/warm.py's MAX_GROUPS)."""
    memory_mb: float | None = None
    """--memory-mb: the kept groups' memory budget (None: runtime/warm.py's default, from the memory available)."""
    slots: int = SLOTS
    """--slots: LoRA SFT runs trained at once, each on a slot of one group (runtime/slots.py); 1: one run at a time."""

    def __post_init__(self) -> None:
        if not self.idle_min > 0:
            raise ConfigError(f"--idle-min={self.idle_min:g}: must be > 0")
        if self.max_groups is not None and self.max_groups < 1:
            raise ConfigError(f"--max-groups={self.max_groups}: must be >= 1")
        if self.memory_mb is not None and not self.memory_mb > 0:
            raise ConfigError(f"--memory-mb={self.memory_mb:g}: must be > 0")
        if self.slots < 1:
            raise ConfigError(f"--slots={self.slots}: must be >= 1 (1: one run at a time)")

    def host_args(self) -> list[str]:
        """What the pool's process is started with besides its address (place/pools.py start_host)."""
        return [str(self.max_groups or 0), str(self.memory_mb or 0), str(self.slots)]  # 0: the default


UP_FLAGS = {"--idle-min": ("idle_min", float, "a number of minutes"), "--max-groups": ("max_groups", int, "a whole number"),
            "--memory-mb": ("memory_mb", float, "a number of MiB"), "--slots": ("slots", int, "a whole number")}  # fmt: skip
"""`up`'s own flags: (UpOptions field, its type, what it takes in words)."""


def up_options(args: list[str]) -> tuple[UpOptions, list[str]]:
    """--idle-min N, --max-groups N, --memory-mb N, --slots N (or --name=N) out of `args`.

    The rest are a run's overrides. Anything else that starts with "-" is a mistyped flag (Hydra would take it for an
    override)."""
    values, rest, items = {}, [], iter(args)
    for arg in items:
        flag, equals, value = arg.partition("=")
        if flag not in UP_FLAGS:
            if arg.startswith("-"):
                raise ConfigError(f"no such flag {flag}" + suggest(flag, UP_FLAGS, "pool up's flags:"))
            rest.append(arg)
            continue
        value = value if equals else next(items, None)
        name, kind, what = UP_FLAGS[flag]
        if value is None:
            raise ConfigError(f"{flag}: no value given (it takes {what})")
        try:
            values[name] = kind(value)
        except ValueError:
            raise ConfigError(f"{flag}={value}: not {what}") from None
    return UpOptions(**values), rest


def no_arguments(command: str, args: list[str]) -> None:
    """`status` and `down` take no arguments: one given is refused, not ignored.

    `down lora=r8` would end the whole pool, not a group of it."""
    if not args:
        return
    flag = args[0].partition("=")[0]
    what = f"no such flag {flag}" if flag.startswith("-") else masked(" ".join(args))
    raise ConfigError(f"{what}: pool {command} takes no arguments (overrides are pool up's, and a run's)")


def up(args: list[str]) -> int:
    """Check the overrides as a run would, start the pool if none answers, have it build the group for runs like these.

    Nothing is started on a mistake. Another `up` building at the same time is waited for (its pool serves)."""
    from tinker_exp.place.lease import Lease, run_payload
    from tinker_exp.place.pools import START_TIMEOUT_S

    options, overrides = up_options(args)
    idle = options.idle_min
    cfg = checked_config(overrides)
    check_for_a_pool(cfg)
    address = wire.address_of()
    wire.make_private(address.parent)  # one line when the folder is not this user's alone
    started, restarts, deadline = None, 0, time.monotonic() + START_TIMEOUT_S
    while True:
        was_up = answers(address)
        if not was_up:
            started = start_host(address, idle * 60, host_args=options.host_args())
            if started.returncode == wire.ALREADY_EXIT:  # another `up`'s pool serves: not this one's to end
                started = None
        sock = wire.connect(address, None)
        wire.send(sock, ("prepare", {"code": wire.code_fingerprint(), "pid": os.getpid(), "who": "pool up", **run_payload((cfg,), cfg)}))
        reply = wire.lease_answer(sock)
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
    slots = reply[1].get("slots", 1)
    at_once = f", {slots} LoRA SFT runs at once on the slots of a group" if slots > 1 else ", one at a time"
    print(f"pool {state} at {address} (pid {reply[1]['pid']}): {described}; runs train on it (backend.pool=auto, the default{at_once}); "
          f"it idles out after {idle:g} min without a run; python -m tinker_exp.pool down frees it")  # fmt: skip
    if state == "already up" and options.slots != slots and any(arg.partition("=")[0] == "--slots" for arg in args):
        print(f"pool: --slots {options.slots} not applied: a pool's slots are set when it starts (it has {slots}); "
              f"python -m tinker_exp.pool down, then up --slots {options.slots}")  # fmt: skip
    return 0


def checked_config(overrides: list[str]):
    """The typed config of `python -m tinker_exp OVERRIDES`, checked (its plan too) as a run checks it."""
    from tinker_exp import config
    from tinker_exp.run import validate

    cfg = config.compose(overrides)
    validate(cfg)
    return cfg


def check_for_a_pool(cfg) -> None:
    """What the pool's process would refuse of `up`'s config only once started, refused here before anything starts.

    In order: several nodes (it would wait for nodes that never join its cluster), then the device, the GPUs of its own
    Ray cluster, the model and LoRA's targets in it, checked as a run checks them before its workers start."""
    from tinker_exp.assemble import workers_inputs

    if cfg.backend.nodes > 1:
        raise ConfigError(f"backend.nodes={cfg.backend.nodes}: a pool holds one machine's workers (a run over several nodes "
                          "starts its own, cold); pool up takes backend.nodes=1")  # fmt: skip
    workers_inputs(cfg)


def status(address: Path) -> int:
    try:
        info = wire.ask(address, ("status",))
    except (OSError, EOFError):
        print(f"no pool is up at {address} (python -m tinker_exp.pool up starts one)")
        return 0
    print(describe_status(info))
    return 0


def describe_status(info: dict) -> str:
    def clock(at: float) -> str:
        return time.strftime("%H:%M:%S", time.localtime(at))

    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
    groups = info["groups"]
    workers = [f"{mb or 0:.0f} (pid {pid})" for group in groups for mb, pid in zip(group["memory_mb"], group["pids"])]
    holder = info["holder"]
    budget = info["memory_budget_mb"]
    kept = [f"  groups kept: {len(groups)} (at most {info['max_groups']}, within {budget:.0f} MiB; the least recently used is freed first)"]
    kept += [
        f"    {i}. {group['group']}; built {clock(group['built_at'])} ({group['size_mb']:.0f} MiB), "
        f"last used {clock(group['last_used'])}, {group['runs']} run{'s' * (group['runs'] != 1)}; workers' pids {', '.join(map(str, group['pids']))}"
        for i, group in enumerate(groups, 1)
    ] or ["    none yet (the next run builds one)"]
    def run(holder: dict) -> str:
        return f"since {clock(holder['since'])} (pid {holder['pid']}: {masked(holder['who']) or 'no overrides'})"

    on_slots = info.get("on_slots") or []
    now = (
        f"running a run {run(holder)}" if holder
        else f"running {len(on_slots)} run{'s' * (len(on_slots) != 1)} on the slots of one group (of {info['slots']}): "
        + "; ".join(f"slot {h.get('slot', '(taking one)')} {run(h)}" for h in on_slots) if on_slots
        else f"idle for {info['idle_for_s'] / 60:.1f} min (ends after {info['idle_s'] / 60:g} min idle)"
    )  # fmt: skip
    return "\n".join([
        f"pool at {info['address']}: pid {info['pid']}, up since {since}",
        *kept,
        f"  runs served: {info['runs']}; now {now}",
        f"  memory (resident, MiB): pool {info['memory_mb']['pool'] or 0:.0f}; workers {', '.join(workers) or '-'}",
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
