"""Shared test helpers (on sys.path through pytest's `pythonpath`; our tests are not a `tests` package)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Iterable

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = REPO / "conf"


def compose(*overrides: str, with_hydra: bool = False):
    """Compose the real configs exactly as `python -m tinker_exp OVERRIDES` would (with the `hydra` node). Each
    test gets a config of its own: a copy of the one composed first in this process for the same overrides (76 of
    test-fast's 291 compositions repeat one; conf/ does not change during a session, and a config's interpolations
    are resolved when read, not here). Not with the `hydra` node, which holds the process's working directory."""
    import copy

    if with_hydra:
        return _compose(overrides, True)
    if overrides not in _composed:
        _composed[overrides] = _compose(overrides, False)
    return copy.deepcopy(_composed[overrides])


_composed: dict[tuple[str, ...], object] = {}


def _compose(overrides: tuple[str, ...], with_hydra: bool):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from tinker_exp.config import register

    register()

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return hydra_compose("config", overrides=list(overrides), return_hydra_config=with_hydra)


def environment(env: dict | None) -> dict:
    """os.environ with `env` on top; a None value removes the variable.

    Never WANDB_SERVICE: a W&B run in the test process sets it, and a CLI run would use that process's service
    instead of its own, as a user's run does."""
    merged = {**os.environ, "WANDB_SERVICE": None, **(env or {})}
    return {key: value for key, value in merged.items() if value is not None}


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python -m tinker_exp ARGS` in `cwd` (the repo), its output captured: forked from this process's CLI zygote
    (tests/cli_zygote.py: the same process, without Python's start-up and the CLI's first imports), or a fresh
    process where `env` changes what those imports read."""
    return run_module("tinker_exp", *args, env=env, timeout=timeout, cwd=cwd)


WARM_LINES = ("pool: training on the warm workers of", "pool: training on the workers just built", "pool: slot ")
"""A run's line when it trains on a pool: on a group the pool kept, on one it built for the run, on a slot."""


def run_warm(pool: dict, *args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """`python -m tinker_exp ARGS` on a warm pool (`pool`: the environment that finds it, conftest.py warm_pool's or
    a test's own), finished with exit 0 and said to have trained there."""
    result = run_cli(*args, env=pool, timeout=timeout, **kwargs)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert any(line in result.stdout for line in WARM_LINES), result.stdout[-3000:]
    return result


def trained_run(run_dir: Path, pool: dict, *command: str) -> Path:
    """A real CLI run of `command` into `run_dir` on the session's warm pool, finished with exit 0 (a module's shared
    run, asserted on by several tests)."""
    run_warm(pool, *command, f"hydra.run.dir={run_dir}")
    return run_dir


def run_module(module: str, *args: str, env: dict | None = None, timeout: float = 300, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` (tinker_exp.report, tinker_exp.forecast, ...) as run_cli runs the CLI."""
    return _run_forked([sys.executable, "-m", module, *args], env, timeout, cwd)


FAKE_CLI = REPO / "tests" / "fake_cli.py"


def run_fake_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python tests/fake_cli.py ARGS` (the real CLI with FakeWorkers) as run_cli runs the CLI: forked from the CLI
    zygote, which has imported what it imports."""
    return run_script(FAKE_CLI, *args, env=env, timeout=timeout)


def run_script(script: Path, *args: str, env: dict | None = None, timeout: float = 300, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` in `cwd` (the repo), its output captured, forked from the CLI zygote as run_cli is."""
    return _run_forked([sys.executable, str(script), *args], env, timeout, cwd)


def start_fake_cli(*args: str, env: dict | None = None, default_sigint: bool = False) -> ForkedProcess | subprocess.Popen:
    """`python tests/fake_cli.py ARGS` started and left running (a run holding a run dir, one to signal): forked from
    the CLI zygote as run_fake_cli, its own process (its pid is the run's: the lock's holder, W&B's service's
    parent), driven as a subprocess.Popen with stdout and stderr piped. default_sigint: SIGINT raises
    KeyboardInterrupt in it, as in a fresh Python whose SIGINT is not ignored (a suite run under `&` ignores it)."""
    return _start_forked([sys.executable, str(FAKE_CLI), *args], env, default_sigint)


def start_cli(*args: str, env: dict | None = None, default_sigint: bool = False, output: Path | None = None) -> ForkedProcess | subprocess.Popen:
    """`python -m tinker_exp ARGS` started and left running (a run or sweep to signal or kill mid-run), as
    start_fake_cli starts the fake one: forked from the CLI zygote (no Python start-up, no CLI imports: about 8
    CPU-s a process), its own process. `output`: a file that gets stdout and stderr both, as it is written (a log to
    poll), as Popen's stdout=file, stderr=STDOUT."""
    return _start_forked([sys.executable, "-m", "tinker_exp", *args], env, default_sigint, output)


def _start_forked(command: list[str], env: dict | None, default_sigint: bool, output: Path | None = None) -> ForkedProcess | subprocess.Popen:
    merged = environment(env)
    if _unsafe_for_the_zygote(merged):
        preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if default_sigint else None
        if output is None:
            return subprocess.Popen(command, cwd=REPO, env=merged, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    preexec_fn=preexec)  # fmt: skip
        with open(output, "w") as out:
            return subprocess.Popen(command, cwd=REPO, env=merged, stdout=out, stderr=subprocess.STDOUT, preexec_fn=preexec)
    return _cli_zygote().run_in_child(command, merged, REPO, default_sigint, output)


def _unsafe_for_the_zygote(env: dict) -> bool:
    """Whether `env` changes a variable the zygote's imports read from what they saw (Ray's, say, which ray.init in
    this process sets after a zygote started). A variable the zygote added for them, `env` may leave out."""
    seen, added = _cli_zygote().seen()
    changed = {key for key in {*env, *seen} if env.get(key, added.get(key)) != seen.get(key)}
    return any(key.startswith(ZYGOTE_UNSAFE_ENV) and key not in ZYGOTE_SAFE_ENV for key in changed)


def _run_forked(command: list[str], env: dict | None, timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    merged = environment(env)
    if _unsafe_for_the_zygote(merged):
        return subprocess.run(command, cwd=cwd, env=merged, capture_output=True, text=True, timeout=timeout)
    process = _cli_zygote().run_in_child(command, merged, cwd)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as expired:  # as subprocess.run: the process killed, with what it wrote
        process.kill()
        process.wait()
        expired.output, expired.stderr = process.read_output()
        raise
    finally:
        process.remove_output()
    return subprocess.CompletedProcess(command, process.returncode, out, err)


ZYGOTE_UNSAFE_ENV = ("HF_", "TRANSFORMERS", "PYTHON", "OMP_", "OPENBLAS", "MKL", "NUMPY", "TORCH", "HYDRA", "VERL", "RAY_", "MPL")
"""Variables read while the zygote imports the CLI's modules: a call that changes one gets a fresh process. Not W&B's:
the zygote does not import wandb (cli_zygote.preload), a run reads them when it starts W&B."""
ZYGOTE_SAFE_ENV = {"RAY_ADDRESS", "TORCHINDUCTOR_CACHE_DIR"}
"""Of those, the ones read only later (ray.init; the inductor's cache when something compiles), never at import.
`import torch._dynamo` sets TORCHINDUCTOR_CACHE_DIR, so a server started by a process that had imported torch has it
where a worker's environment may not: such workers started fresh for it (42 of 311 in one CI)."""


class ForkedProcess:
    """A child of the CLI zygote, driven as a subprocess.Popen (pid, poll, wait, communicate, signals); its stdout and
    stderr are files, read once it has ended. The zygote, not this process, waits for it: its exit status comes
    back on this process's connection to the zygote (which kills the child if the connection closes first)."""

    def __init__(self, args: list[str], connection, folder: Path):
        self.args, self.returncode, self._folder = args, None, folder
        self._connection, self._received = connection, b""
        pid = self._answer(None)
        if pid is None:
            raise subprocess.SubprocessError(f"the CLI zygote did not start {args}")
        self.pid = pid

    def _answer(self, timeout: float | None) -> int | None:
        """The zygote's next answer (a pid, then the exit status); None if none came within `timeout`."""
        import select

        while b"\n" not in self._received:
            if not select.select([self._connection], [], [], timeout)[0]:
                return None
            chunk = self._connection.recv(1 << 16)
            if not chunk:
                raise RuntimeError(f"the CLI zygote ended while {self.args} ran")
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        answer = json.loads(line)
        return answer.get("pid", answer.get("rc"))

    def poll(self) -> int | None:
        self._ended(0)
        return self.returncode

    def _ended(self, timeout: float | None) -> bool:
        if self.returncode is None:
            self.returncode = self._answer(timeout)
            if self.returncode is not None:
                self._connection.close()
        return self.returncode is not None

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.read_output()

    def read_output(self) -> tuple[str, str]:
        return (self._folder / "stdout").read_text(), (self._folder / "stderr").read_text()

    def remove_output(self) -> None:
        import shutil

        shutil.rmtree(self._folder, ignore_errors=True)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # not once it has ended: its pid may be another process's by then
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class CliZygote:
    """A tests/cli_zygote.py: its folder of sockets (`cli` for runs, `job` for local sweep jobs) and, when this
    process started it, its process. Under xdist the controller starts one for both workers (conftest); a process
    without one starts its own at its first call."""

    def __init__(self, folder: Path, process: subprocess.Popen | None = None):
        import itertools

        from zygotes import client_command

        self.folder, self.process, self.ids, self._seen = folder, process, itertools.count(), None
        self.job_python = client_command(str(folder / "job"))  # the name tells zygotes.py's client a job's server

    @classmethod
    def start(cls) -> CliZygote:
        """A zygote of this process's environment, in a folder of its own; ends when this process does (its stdin)."""
        import tempfile

        from cli_zygote import SOCKETS_ENV

        folder = Path(tempfile.mkdtemp(prefix="tinker_exp-cli-"))
        process = subprocess.Popen([sys.executable, str(REPO / "tests" / "cli_zygote.py")], cwd=REPO,
                                   env={**environment(None), SOCKETS_ENV: str(folder)}, stdin=subprocess.PIPE)  # fmt: skip
        return cls(folder, process)

    def seen(self) -> tuple[dict, dict]:
        """(the environment its imports saw, what it added to it for them): cli_zygote.SEEN_FILE, once written."""
        from cli_zygote import SEEN_FILE

        deadline = time.monotonic() + 300
        while self._seen is None:
            path = self.folder / SEEN_FILE
            if path.exists():
                self._seen = json.loads(path.read_text())
            elif time.monotonic() > deadline or (self.process is not None and self.process.poll() is not None):
                raise RuntimeError(f"the CLI zygote in {self.folder} never wrote {SEEN_FILE}")
            else:
                time.sleep(0.05)
        return self._seen["seen"], self._seen["added"]

    def stop(self) -> None:
        import shutil

        if self.process is not None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.folder, ignore_errors=True)

    def run_in_child(self, command: list[str], env: dict, cwd: Path, default_sigint: bool = False, output: Path | None = None) -> ForkedProcess:
        """`command` (`python -m MODULE ARGS` or `python SCRIPT ARGS`) forked from the zygote, running. `output`: one
        file for its stdout and stderr (read_output then reads nothing)."""
        import socket
        import tempfile

        from zygotes import JOB_PYTHON_ENV

        env = {JOB_PYTHON_ENV: self.job_python, **env}  # its local sweep jobs fork here too (unless the session's server takes them)
        folder = Path(tempfile.mkdtemp(prefix=f"run{next(self.ids)}-", dir=self.folder))
        (folder / "stdout").write_text(""), (folder / "stderr").write_text("")
        if output is not None:
            Path(output).write_text("")
        stdout, stderr = (str(output), str(output)) if output is not None else (str(folder / "stdout"), str(folder / "stderr"))
        request = {"args": command[1:], "env": env, "cwd": str(cwd), "stdout": stdout, "stderr": stderr, "default_sigint": default_sigint}
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + 120
        while True:  # its sockets are there a moment after it starts
            try:
                connection.connect(str(self.folder / "cli"))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline or (self.process is not None and self.process.poll() is not None):
                    raise
                time.sleep(0.05)
        connection.sendall(json.dumps(request).encode() + b"\n")
        return ForkedProcess(command, connection, folder)


ZYGOTE_FOLDER_ENV = "TINKER_EXP_CLI_ZYGOTE"
"""Set by conftest in the xdist workers' environment: the controller's zygote (cli_zygote.SOCKETS_ENV's folder)."""
_zygote: CliZygote | None = None


def _cli_zygote() -> CliZygote:
    global _zygote
    if _zygote is None and os.environ.get(ZYGOTE_FOLDER_ENV):
        _zygote = CliZygote(Path(os.environ[ZYGOTE_FOLDER_ENV]))
    if _zygote is None or (_zygote.process is not None and _zygote.process.poll() is not None):
        import atexit

        _zygote = CliZygote.start()
        atexit.register(_zygote.stop)
    return _zygote


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def planned(run_dir: Path, name: str) -> list[float]:
    """Every step's value of one plan column (lr, beta1, ...) as the run planned it, rebuilt from its plan.json."""
    from tinker_exp.optim.preview import PLAN_FILE, read_plan_file

    return read_plan_file(run_dir / PLAN_FILE).column(name).tolist()


def metrics_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl of a run that may still be writing it (no file yet, or a last line half written)."""
    from tinker_exp.formats import read_jsonl as read_complete_rows

    path = run_dir / "metrics.jsonl"
    return read_complete_rows(path) if path.exists() else []


def wait_until(condition, timeout: float, what: str, process: subprocess.Popen | None = None, poll: float = 0.2) -> None:
    """Poll `condition` until it holds; fail with `what` after `timeout` s, or as soon as `process` has exited."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline and (process is None or process.poll() is None), what
        time.sleep(poll)


def job_json(run_dir: Path) -> dict:
    """What a job wrote about itself (`job.json`: Slurm job id, restart count, ...)."""
    return json.loads((run_dir / "job.json").read_text())


def read_job_log(sweep_dir: Path, job_id: str) -> str:
    """A sweep job's submitit logs (stdout and stderr, every start of it)."""
    return "".join(p.read_text() for p in sorted((sweep_dir / ".submitit" / job_id).glob("*_log.*")))


def job_processes(job_ids: Iterable[str]) -> list[str]:
    """`pid node command` of every process on this machine (all nodes of the local cluster) that belongs to one of
    these Slurm jobs: its environment names the job (Ray's processes inherit it from their task)."""
    wanted = {f"SLURM_JOB_ID={job_id}".encode() for job_id in job_ids}
    found = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if wanted.intersection(environ):
            node = next((e.decode().partition("=")[2] for e in environ if e.startswith(b"SLURMD_NODENAME=")), "?")
            found.append(f"{proc.name} {node} {command}")
    return found


COSINE_TRUNK = [
    "+override=lr_cosine", "override.lr.warmup_steps=2", "trainer.steps=12", "checkpoint.every_steps=4", "checkpoint.keep_last=0",
]  # fmt: skip
"""The command of the real CLI run several tests share (conftest.py's cosine_trunk; W&B offline): 12 steps of a cosine
lr, a checkpoint every 4 steps, all kept."""

SLURM_NODES = 2
"""Nodes of the local Slurm cluster the tests share (.ci/run starts it with the same count)."""


def slurm_nodes_idle(slurm_env: dict) -> bool:
    """Every node idle: no job (or the last instance of one, still cleaning up) holds any of them."""
    states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=environment(slurm_env), capture_output=True, text=True).stdout.split()
    return bool(states) and all(state == "idle" for state in states)


def squeue(slurm_env: dict) -> str:
    """`JOBID STATE` lines of the local Slurm cluster's queue."""
    return subprocess.run(["squeue", "-h", "-o", "%i %T"], env=environment(slurm_env), capture_output=True, text=True).stdout


def requeue_at_time_limit(slurm_env: dict, job_id: str, queued_as: str, driver: subprocess.Popen) -> float:
    """Send a running job the time-limit signal (USR2, what Slurm sends `signal_delay_s` before the limit), so that
    submitit requeues it; wait until it is back in the queue and its first start has left the node, then release it
    sooner than Slurm's hold (which keeps a requeued batch job a while, so that its new credential postdates the old
    one's revocation). `queued_as`: its id as squeue shows it (an array task's `<array>_<task>`). Returns when the
    signal was sent (time.time())."""
    slurm = environment(slurm_env)
    subprocess.run(["scancel", "--signal=USR2", job_id], env=slurm, check=True)
    sent = time.time()
    wait_until(lambda: f"{queued_as} PENDING" in squeue(slurm_env).splitlines(), 240, f"job {queued_as} was not requeued", driver)
    wait_until(lambda: not job_processes([job_id]), 240, f"job {queued_as}'s first start did not end")
    subprocess.run(["scontrol", "update", f"JobId={queued_as}", "StartTime=now+5"], env=slurm, check=True)
    return sent


def cancel_leftover_jobs(slurm_env: dict, timeout: float = 120) -> None:
    """Cancel every job in the local cluster's queue and wait until its nodes are idle."""
    jobs = [line.split()[0] for line in squeue(slurm_env).splitlines() if line.strip()]
    if jobs:
        subprocess.run(["scancel", *jobs], env=environment(slurm_env), capture_output=True)
    wait_until(lambda: not squeue(slurm_env).strip() and slurm_nodes_idle(slurm_env), timeout, f"jobs {jobs} not gone", poll=1)


def slurm_state(slurm_env: dict, folder: Path | None = None, lines: int = 15) -> str:
    """What to read when a Slurm test fails: the queue, the nodes, the controller's log, and the last lines of
    every log under `folder` (drivers', submitit's, the runs')."""
    env = environment(slurm_env)
    commands = [["squeue", "-o", "%i %T %r %N %M"], ["sinfo", "-N", "-o", "%N %T %E"]]
    parts = [f"$ {' '.join(c)}\n" + subprocess.run(c, env=env, capture_output=True, text=True).stdout for c in commands]
    logs = [Path(slurm_env["SLURM_CONF"]).parent.parent / "log" / "slurmctld.log"]
    if folder is not None:
        logs += sorted(p for p in folder.rglob("*") if p.is_file() and (p.suffix in (".log", ".out", ".err")))
    for log in logs:
        if log.exists():
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log} (last {len(tail)} lines)\n" + "\n".join(line[:300] for line in tail))
    return "\n".join(parts)


# --- W&B 0.31 offline run file: 7-byte header, then LevelDB-log records in 32 KiB blocks --------------
WANDB_HEADER = b":W&B" + struct.pack("<H", 0xBEE1) + b"\x00"
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """Every complete Record in a .wandb file, in order (a file being written may end in a partial chunk);
    checks each chunk's CRC-32."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == WANDB_HEADER, f"{path}: not a W&B run file"
    records, pending, offset = [], b"", 7
    while offset + 7 <= len(data):
        left_in_block = BLOCK - offset % BLOCK
        if left_in_block < 7:  # zero padding at a block's end
            offset += left_in_block
            continue
        crc, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        if kind == 0 and length == 0:
            break
        if offset + 7 + length > len(data):  # the writer is not done with this chunk
            break
        payload = data[offset + 7 : offset + 7 + length]
        assert crc == zlib.crc32(payload, zlib.crc32(bytes([kind]))), f"{path}: bad CRC at {offset}"
        offset += 7 + length
        if kind in (FULL, FIRST):
            pending = payload
        else:
            pending += payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(records: list) -> list[dict]:
    """History rows as {key: value}; keys are the joined nested_key paths (e.g. 'train/loss')."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            rows.append({"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item})
    return rows


def wandb_finished_records(run: Path, timeout: float = 60) -> list:
    """The records of a run that finished (`run`: its run dir, or one part's .wandb file of a resumed run): W&B's
    service may write the exit record to the file a moment after run.finish() returns (seen under load), so wait for it."""
    import time

    path = run if run.suffix == ".wandb" else wandb_run_file(run)
    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def wandb_run_record(records: list):
    """The run record (id, project, group, display name, config) of a .wandb file."""
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


def wandb_run_file(run_dir: Path) -> Path:
    (path,) = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    return path


def verl_adamw(values: dict):
    """A real AdamW built by verl from the same FSDPOptimizerConfig fields TinkerWorkers passes (two param groups)."""
    import torch
    from verl.workers.config import FSDPOptimizerConfig, build_optimizer

    config = FSDPOptimizerConfig(
        lr=values["lr"],
        betas=values["betas"],
        weight_decay=values["weight_decay"],
        override_optimizer_config={"eps": values["eps"]},
    )
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters()}]
    return build_optimizer(groups, config)


def wandb_train_rows(run_dir: Path) -> list[dict]:
    """The steps W&B has written so far (the file may be half written: complete records only)."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    return [row for row in wandb_history(wandb_records(files[0])) if "train/loss" in row] if files else []


def optimizer_for(override_file: str) -> list[str]:
    """The optimizer an override file of conf/override/ is for: one named after another optimizer than the default
    (sgd_one_cycle) is composed with it (optimizer=sgd); the others with the default."""
    prefix = override_file.split("_")[0]
    return [f"optimizer={prefix}"] if (CONF_DIR / "optimizer" / f"{prefix}.yaml").exists() else []


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m tinker_exp ARGS`, in this process (faster than a subprocess, and
    what a user's shell sees: the entry point's exit status and its lines)."""
    import pytest

    from tinker_exp.main import main

    monkeypatch.setattr(sys, "argv", ["tinker_exp", *args])
    with pytest.raises(SystemExit) as stopped:
        main()
    out = capsys.readouterr()
    return stopped.value.code, out.out, out.err


TIMINGS = ("time", "perf/")
"""What may differ between two runs of one command: when a row was written and how long things took."""


def without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMINGS)} for row in rows]


PACKED_RELATIVE = 1e-5
"""The issue's bound on a logged value's difference, a trial's steps packed with other slots' against the trial alone
(fp32, runtime/packed.py): the largest measured over 21 steps of 3 packed trials was 1.7e-7 on a loss, 2.6e-6 on a
grad norm (tests/test_slots.py, docs/slots.md)."""
PACKED_ADAPTER_RELATIVE = 1e-3
"""The bound on an exported adapter tensor's difference, packed against alone (the norm of the difference over
alone's): measured up to 2.7e-4 (lr 5e-3, after 2 steps; 3.0e-5 after 21). Wider than PACKED_RELATIVE: Adam's update
of an element whose gradient is below its eps (1e-8) is about lr/eps times the gradient, so a last-digit difference
of such a gradient becomes a visible one in the weights. The gradients themselves agree: with SGD (lr 0.5, 5 packed
steps of 3 slots) no tensor differed by more than 1e-6."""


def relative(a: float, b: float) -> float:
    return 0.0 if a == b else abs(a - b) / max(abs(a), abs(b))


def assert_rows_close(rows: list[dict], alone: list[dict]) -> float:
    """Every row's keys and non-float values (timings aside) equal alone's, its floats within PACKED_RELATIVE;
    returns the largest relative difference."""
    rows, alone = without_timings(rows), without_timings(alone)
    assert [sorted(r) for r in rows] == [sorted(r) for r in alone]
    worst = 0.0
    for row, other in zip(rows, alone, strict=True):
        for key, value in row.items():
            if isinstance(value, float):
                worst = max(worst, relative(value, other[key]))
            else:
                assert value == other[key], key
    assert worst <= PACKED_RELATIVE, worst
    return worst


def adapters_difference(path: Path, alone_path: Path) -> float:
    """The largest difference of two adapters' tensors (safetensors files), each relative to alone's: the norm of the
    difference over alone's norm (an element's own relative difference is not bounded: PACKED_ADAPTER_RELATIVE)."""
    from safetensors.torch import load_file

    mine, theirs = load_file(str(path)), load_file(str(alone_path))
    assert sorted(mine) == sorted(theirs)
    return max(float((mine[k] - theirs[k]).norm() / theirs[k].norm()) for k in mine)


def assert_adapters_close(path: Path, alone_path: Path) -> None:
    worst = adapters_difference(path, alone_path)
    assert worst <= PACKED_ADAPTER_RELATIVE, worst


def storage_trials(sweep_dir: Path, name: str = "tinker_exp") -> list:
    """The study as the sweeper left it in its sweep dir: Optuna's journal file, read with Optuna's own classes."""
    import optuna

    assert (sweep_dir / "optuna.journal").exists() and not (sweep_dir / "optuna.db").exists()
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(sweep_dir / "optuna.journal")))
    return optuna.load_study(study_name=name, storage=storage).trials
