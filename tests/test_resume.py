"""Real resumes: 2 Ray CPU workers, the driver killed with SIGKILL mid-run, corrupt checkpoints, NaN policy."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import (
    REPO,
    environment,
    job_json,
    metrics_rows,
    planned,
    read_job_log,
    read_jsonl,
    run_cli,
    slurm_nodes_idle,
    squeue,
    wait_until,
    wandb_history,
    wandb_records,
)

STEPS = 12
# lr follows a cosine schedule, so a resumed run must continue the plan at the right step, not restart it.
COMMON = [f"trainer.steps={STEPS}", "checkpoint.every_steps=4", "+override=lr_cosine", "override.lr.warmup_steps=2"]


def launch(run_dir: Path, ray_address: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tinker_exp", *COMMON, f"hydra.run.dir={run_dir}", *extra],
        cwd=REPO, env=environment({"RAY_ADDRESS": ray_address}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(ray_address, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = run_cli(*COMMON, f"hydra.run.dir={run_dir}", env={"RAY_ADDRESS": ray_address})
    assert result.returncode == 0, result.stderr[-3000:]
    return metrics_rows(run_dir)


def test_sigkill_mid_run_then_rerun_continues_at_the_exact_step(ray_address, uninterrupted, tmp_path):
    driver = launch(tmp_path, ray_address)
    try:
        # a checkpoint at 4 steps, and steps 4 and 5 logged after it
        wait_until(lambda: len(metrics_rows(tmp_path)) >= 6, 240, "the run never got to step 6", driver, poll=0.1)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        driver.kill()
    killed_at = len(metrics_rows(tmp_path))
    assert 6 <= killed_at < STEPS and (tmp_path / "checkpoints" / "step_00000004" / "MANIFEST.json").exists()

    result = run_cli(*COMMON, f"hydra.run.dir={tmp_path}", env={"RAY_ADDRESS": ray_address})  # the same command
    assert result.returncode == 0, result.stderr[-3000:]
    resumed_from = int(result.stdout.split("at step ")[1].split()[0])
    assert 4 <= resumed_from <= killed_at
    rows = metrics_rows(tmp_path)
    assert [row["train/step"] for row in rows] == list(range(STEPS))  # each step exactly once
    assert [row["applied/lr"] for row in rows] == planned(tmp_path, "lr")  # the plan continued
    # Same seed, same data order, model + optimizer + RNG restored: CPU gloo runs are bitwise equal.
    assert len(rows) == len(uninterrupted) == STEPS
    for got, want in zip(rows, uninterrupted):
        assert (got["train/loss"], got["train/grad_norm"]) == (want["train/loss"], want["train/grad_norm"])

    # W&B: one run id, resumed; offline it is two parts (W&B appends them when synced).
    parts = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    run_id = (tmp_path / "wandb_run_id").read_text()
    assert len(parts) == 2 and all(part.name == f"run-{run_id}.wandb" for part in parts)
    second = [row["train/step"] for row in wandb_history(wandb_records(parts[1])) if "train/loss" in row]
    assert second == list(range(resumed_from, STEPS))


def test_a_checkpoint_that_does_not_load_is_a_clear_error(ray_address, tmp_path):
    first = run_cli(*COMMON, "trainer.steps=6", "logger=none", f"hydra.run.dir={tmp_path}", env={"RAY_ADDRESS": ray_address})
    assert first.returncode == 0, first.stderr[-3000:]
    (tmp_path / "checkpoints" / "step_00000006").rename(tmp_path / "elsewhere")  # as if killed at step 6
    shard = tmp_path / "checkpoints" / "step_00000004" / "workers" / "model_world_size_2_rank_0.pt"
    shard.write_bytes(b"\x00" * shard.stat().st_size)  # same size: passes the manifest's size check
    result = run_cli(*COMMON, "logger=none", f"hydra.run.dir={tmp_path}", env={"RAY_ADDRESS": ray_address})
    assert result.returncode == 5
    assert f"tinker_exp: checkpoint error: {shard.parent.parent}: verl could not load it" in result.stderr
    assert [row["train/step"] for row in metrics_rows(tmp_path)] == [0, 1, 2, 3, 4, 5]  # nothing logged is lost


def test_non_finite_steps_stop_the_run_keeping_the_last_good_checkpoint(ray_address, tmp_path):
    # lr jumps to 1e30 for step 4: its update blows the weights up, so step 5's gradients are not finite.
    result = run_cli(
        "trainer.steps=10", "checkpoint.every_steps=2", "logger=none", f"hydra.run.dir={tmp_path}",
        "+override.lr={schedule:keyframes,points:{0:0.001,3:0.001,4:1e30,9:1e30}}",
        env={"RAY_ADDRESS": ray_address},
    )  # fmt: skip
    assert result.returncode == 4, result.stderr[-3000:]
    assert re.search(r"tinker_exp: stopped on non-finite values: step 5: loss=\S+, grad_norm=nan; 1 non-finite", result.stderr)
    rows = metrics_rows(tmp_path)
    assert [row["train/nonfinite_steps"] for row in rows] == [0, 0, 0, 0, 0, 1]
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints == ["step_00000002", "step_00000004"]  # nothing saved after the failure
    state = json.loads((tmp_path / "checkpoints" / "step_00000004" / "loop.json").read_text())
    assert state["step"] == 4 and state["nonfinite_steps"] == 0


@pytest.mark.parametrize(
    "stop",
    [
        ["scontrol", "requeue"],  # preemption with requeue: Slurm signals the job and puts it back in the queue
        ["scancel", "--signal=USR2"],  # the time-limit warning (signal_delay_s): submitit requeues the job itself
    ],
    ids=["preempted", "time-limit-signal"],
)
def test_a_requeued_slurm_job_resumes_from_its_checkpoint(slurm_env, tmp_path, stop):
    command = [
        sys.executable, "-m", "tinker_exp", "-m", "hydra/launcher=slurm_local", f"hydra.sweep.dir={tmp_path}",
        "trainer.steps=40", "checkpoint.every_steps=5", "logger=none", "+override=lr_cosine",
    ]  # fmt: skip
    slurm = environment(slurm_env)
    driver = subprocess.Popen(command, cwd=REPO, env=slurm, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "0"
    try:
        checkpoint = run_dir / "checkpoints" / "step_00000010" / "MANIFEST.json"
        wait_until(checkpoint.exists, 180, "no checkpoint at step 10", driver)
        job_id = job_json(run_dir)["slurm"]["job_id"]
        subprocess.run([*stop, job_id], env=slurm, check=True)
        # Slurm holds a requeued batch job for a while (so that its new credential postdates the old one's
        # revocation): release it sooner, once the node is done with the first start, and still a few seconds
        # later. A start in the same second as the revocation is killed by slurmd: "Job credential revoked".
        wait_until(lambda: f"{job_id} PENDING" in squeue(slurm_env).splitlines(), 240, "the job was not requeued")
        wait_until(lambda: slurm_nodes_idle(slurm_env), 240, "the node did not finish the first start")
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+5"], env=slurm, check=True)
        output, _ = driver.communicate(timeout=300)
    finally:
        driver.kill()
    assert driver.returncode == 0, output[-3000:]
    assert job_json(run_dir)["slurm"]["restart_count"] == "1"  # the second start
    rows = metrics_rows(run_dir)
    assert [row["train/step"] for row in rows] == list(range(40))  # each step once across both starts
    assert [row["applied/lr"] for row in rows] == planned(run_dir, "lr")
    assert read_jsonl(tmp_path / "summary.jsonl")[0]["status"] == "COMPLETED"
    # The first start stopped by itself (not killed at KillWait), leaving no result behind for the launcher.
    job_log = read_job_log(tmp_path, job_id)
    # Slurm signals every process of the job at once. 143: our SIGTERM handler stopped the run; 1: Ray's raylet
    # died first and Ray's core worker ended the driver (it does that on losing its raylet; a race we cannot win
    # under load). Either way the first start ended by itself, before Slurm's SIGKILL, and the job was requeued.
    assert re.search(r"task 0: Exited with exit code (143|1)$", job_log, re.M) and "Killed" not in job_log, job_log[-3000:]
    if stop[0] == "scancel":
        # submitit's USR2 handler ran and requeued the job (restart_count above); its own "Requeued job" line
        # may never be written: Slurm's SIGTERM for that requeue can stop the process before submitit logs it.
        assert "this job is preempted" in job_log
