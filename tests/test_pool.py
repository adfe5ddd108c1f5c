"""Warm workers (tinker_exp/pool/): real pools of verl workers on Ray, and real CLI runs on them compared bitwise with
cold runs of the same commands (every metrics.jsonl value but timings): SFT, LoRA, RL, resume and a branch; a run
killed mid-step, then a good run; a second run refused while one runs; up, status and down."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import COSINE_TRUNK, REPO, environment, metrics_rows, run_cli, run_module, wait_until

pytestmark = pytest.mark.real

TIMINGS = ("time", "perf/")
"""What may differ between two runs of one command: when a row was written and how long things took."""


def without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMINGS)} for row in rows]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A pool of this module's (`pool up`, in a folder of its own), and the environment its runs need to find it.
    Its own Ray cluster: never the session's (no RAY_ADDRESS)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="txp-", dir="/tmp"))
    env = {"TINKER_EXP_POOL_DIR": str(folder), "TINKER_EXP_POOL": "auto", "RAY_ADDRESS": None}
    up = run_module("tinker_exp.pool", "up", "--idle-min", "15", env=env, timeout=400)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:] + (folder / "pool.log").read_text()[-3000:]
    assert "pool up at" in up.stdout and "2 x TinkerTrainingWorker on cpu" in up.stdout
    yield env
    down = run_module("tinker_exp.pool", "down", env=env, timeout=120)
    assert "pool down" in down.stdout, down.stdout + down.stderr
    shutil.rmtree(folder, ignore_errors=True)


def warm(pool: dict, *args: str, **kwargs) -> subprocess.CompletedProcess:
    result = run_cli(*args, env=pool, **kwargs)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "pool: training on the warm workers of" in result.stdout
    return result


def cold(ray_address: str, *args: str) -> subprocess.CompletedProcess:
    result = run_cli(*args, "backend.pool=none", env={"RAY_ADDRESS": ray_address})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warm workers" not in result.stdout
    return result


def test_a_killed_run_leaves_the_pool_usable_a_second_run_is_refused_and_a_warm_run_is_the_cold_run(pool, cosine_trunk, tmp_path):
    long_run = subprocess.Popen(
        [sys.executable, "-m", "tinker_exp", "trainer.steps=400", "checkpoint.every_steps=0", f"hydra.run.dir={tmp_path / 'killed'}"],
        cwd=REPO, env=environment(pool), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: len(metrics_rows(tmp_path / "killed")) >= 3, 240, "the warm run never logged 3 steps", long_run)
        refused = run_cli("trainer.steps=2", f"hydra.run.dir={tmp_path / 'refused'}", env=pool)
        status = run_module("tinker_exp.pool", "status", env=pool)
        long_run.send_signal(signal.SIGKILL)  # mid-run: between two steps or inside one
        long_run.wait(timeout=30)
    finally:
        long_run.kill()
    assert refused.returncode == 2
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith("tinker_exp: pool busy: backend.pool=auto: the pool at") and "one run at a time" in line
    assert not (tmp_path / "refused").exists()  # refused before anything was written
    assert "now running a run since" in status.stdout and "trainer.steps=400" in status.stdout

    # The next run waits for the killed one to end, then trains exactly as the suite's cold run of its command.
    run_dir = tmp_path / "after"
    warm(pool, *COSINE_TRUNK, f"hydra.run.dir={run_dir}")
    assert without_timings(metrics_rows(run_dir)) == without_timings(metrics_rows(cosine_trunk[0]))
    status = run_module("tinker_exp.pool", "status", env=pool)
    assert "runs served: 2" in status.stdout and "now idle" in status.stdout


def test_resume_and_a_branch_on_the_pool_are_bitwise_cold_ones(pool, cosine_trunk, ray_address, tmp_path):
    trunk = cosine_trunk[0]
    resumed = tmp_path / "resumed"
    shutil.copytree(trunk, resumed)
    for step in (8, 12):  # as if it had been stopped after its step-4 checkpoint
        shutil.rmtree(resumed / "checkpoints" / f"step_{step:08d}")
    result = warm(pool, *COSINE_TRUNK, f"hydra.run.dir={resumed}")
    assert "at step 4" in result.stdout
    assert without_timings(metrics_rows(resumed)) == without_timings(metrics_rows(trunk))

    branch = ["+override=lr_wsd", "trainer.steps=7", f"branch.from={trunk}", "branch.step=4"]
    cold(ray_address, *branch, f"hydra.run.dir={tmp_path / 'cold_branch'}")
    warm(pool, *branch, f"hydra.run.dir={tmp_path / 'warm_branch'}")
    cold_rows, warm_rows = (without_timings(metrics_rows(tmp_path / name)) for name in ("cold_branch", "warm_branch"))
    assert [row["train/step"] for row in warm_rows] == [4, 5, 6] and warm_rows == cold_rows


def test_a_worker_that_died_is_replaced_and_the_next_run_is_the_cold_run(pool, cosine_trunk, tmp_path):
    status = run_module("tinker_exp.pool", "status", env=pool).stdout
    pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", status.split("memory", 1)[1])]
    assert len(pids) == 2, status
    os.kill(pids[1], signal.SIGKILL)  # a rank lost (out of memory, say) between two runs
    result = warm(pool, *COSINE_TRUNK, f"hydra.run.dir={tmp_path}")
    assert "pool: a worker had died" in result.stdout and "building the group again" in result.stdout
    assert without_timings(metrics_rows(tmp_path)) == without_timings(metrics_rows(cosine_trunk[0]))
    assert str(pids[1]) not in run_module("tinker_exp.pool", "status", env=pool).stdout


@pytest.mark.parametrize(
    "command",
    [["lora=r8", "trainer.steps=3"], ["env=digits", "loss=importance_sampling", "trainer.steps=2"]],
    ids=["lora", "rl"],
)
def test_lora_and_rl_on_the_pool_are_bitwise_cold_runs(pool, ray_address, tmp_path, command):
    cold(ray_address, *command, f"hydra.run.dir={tmp_path / 'cold'}")
    first = warm(pool, *command, f"hydra.run.dir={tmp_path / 'warm'}")
    again = warm(pool, *command, f"hydra.run.dir={tmp_path / 'again'}")  # the kept group, fresh state
    assert "pool: a new group for this run" in first.stdout and "a new group" not in again.stdout
    rows = without_timings(metrics_rows(tmp_path / "cold"))
    assert len(rows) == int(command[-1].split("=")[1])
    assert without_timings(metrics_rows(tmp_path / "warm")) == rows == without_timings(metrics_rows(tmp_path / "again"))
    if command[0] == "lora=r8":
        adapter = "adapter/adapter_model.safetensors"
        assert (tmp_path / "warm" / adapter).read_bytes() == (tmp_path / "cold" / adapter).read_bytes()


def test_a_pool_left_idle_ends_by_itself(tmp_path):
    """`up --idle-min`'s rule, on a pool process with no group: no run for its idle time, it ends and says why."""
    import tempfile

    from tinker_exp.pool.local import start_host

    address = Path(tempfile.mkdtemp(prefix="txp-", dir="/tmp")) / "idle.sock"
    process = start_host(address, idle_s=1.0)
    try:
        process.wait(timeout=120)
    finally:
        process.kill()
    log = (address.parent / "idle.log").read_text()
    assert process.returncode == 0 and "pool: stopping: idle for" in log and "pool: down" in log, log[-2000:]
    assert not address.exists()
    shutil.rmtree(address.parent, ignore_errors=True)
