"""Shared test helpers (on sys.path through pytest's `pythonpath`; our tests are not a `tests` package)."""

from __future__ import annotations

import json
import os
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
    """Compose the real configs exactly as `python -m tinker_exp OVERRIDES` would (with the `hydra` node)."""
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
    return _run_forked([sys.executable, "-m", "tinker_exp", *args], None, list(args), env, timeout, cwd)


FAKE_CLI = REPO / "tests" / "fake_cli.py"


def run_fake_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python tests/fake_cli.py ARGS` (the real CLI with FakeWorkers) as run_cli runs the CLI: forked from the CLI
    zygote, which has imported what it imports. A test that needs the process itself (its pid, its children, a
    signal) starts `[sys.executable, FAKE_CLI, ...]` with subprocess.Popen instead."""
    return _run_forked([sys.executable, str(FAKE_CLI), *args], str(FAKE_CLI), list(args), env, timeout, REPO)


def _run_forked(command: list[str], script: str | None, args: list[str], env: dict | None, timeout: float,
                cwd: Path) -> subprocess.CompletedProcess:  # fmt: skip
    merged, base = environment(env), environment(None)
    changed = {key for key in {*merged, *base} if merged.get(key) != base.get(key)}
    if any(key.startswith(ZYGOTE_UNSAFE_ENV) and key not in ZYGOTE_SAFE_ENV for key in changed):
        return subprocess.run(command, cwd=cwd, env=merged, capture_output=True, text=True, timeout=timeout)
    return _cli_zygote().run(command, script, args, merged, timeout, cwd)


ZYGOTE_UNSAFE_ENV = ("HF_", "TRANSFORMERS", "PYTHON", "OMP_", "OPENBLAS", "MKL", "NUMPY", "TORCH", "HYDRA", "VERL", "RAY_", "WANDB", "MPL")
"""Variables read while the zygote imports the CLI's modules: a call that changes one gets a fresh process."""
ZYGOTE_SAFE_ENV = {"RAY_ADDRESS"}
"""Of those, the ones read only later (ray.init), never at import."""


class _CliZygote:
    """One tests/cli_zygote.py per test process, started at its first call; calls go one at a time."""

    def __init__(self):
        import tempfile
        import threading

        self.process = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "cli_zygote.py")], cwd=REPO, env=environment(None),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lock, self.dir = threading.Lock(), Path(tempfile.mkdtemp(prefix="tinker_exp-cli-"))

    def run(self, command: list[str], script: str | None, args: list[str], env: dict, timeout: float,
            cwd: Path) -> subprocess.CompletedProcess:  # fmt: skip
        import select
        import signal

        with self.lock:
            out, err = self.dir / "stdout", self.dir / "stderr"
            out.write_text(""), err.write_text("")
            request = {"script": script, "args": args, "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            pid = json.loads(self.process.stdout.readline())["pid"]
            ready, _, _ = select.select([self.process.stdout], [], [], timeout)
            if not ready:  # as subprocess.run: the process killed, TimeoutExpired with what it wrote
                os.kill(pid, signal.SIGKILL)
                self.process.stdout.readline()
                raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
            returncode = json.loads(self.process.stdout.readline())["rc"]
            return subprocess.CompletedProcess(command, returncode, out.read_text(), err.read_text())


_zygote: _CliZygote | None = None


def _cli_zygote() -> _CliZygote:
    global _zygote
    if _zygote is None or _zygote.process.poll() is not None:
        _zygote = _CliZygote()
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


def wandb_finished_records(run_dir: Path, timeout: float = 60) -> list:
    """The records of a run that finished in this process: W&B's service may write the exit record to
    the file a moment after run.finish() returns (seen under load), so wait for it."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(wandb_run_file(run_dir))
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
