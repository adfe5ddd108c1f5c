"""Warm pools where users stop, switch and sweep: real pools of verl workers on Ray, their runs compared bitwise with
cold runs of the same commands (every metrics.jsonl value but timings). A client killed right after handing its run
over; an RL run after a warm SFT run killed mid-run; a local sweep's second job on the sweep's own pool, a seed
change there; Ray's dashboard off. One pool for the module (test_pool's fixture), shared by its tests."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import COSINE_TRUNK, REPO, environment, metrics_rows, run_cli, wait_until
from test_pool import cold, pool, warm, without_timings  # noqa: F401  (pool: the module's real pool, a fixture)

LONG_RUN = ["trainer.steps=2000", "checkpoint.every_steps=0", "checkpoint.at_end=false", "logger=none"]
"""A run that trains for minutes (0.1-0.3 s a step here) unless it is stopped."""


def pool_status(pool: dict) -> dict:
    from tinker_exp.pool import wire

    return wire.ask(Path(pool["TINKER_EXP_POOL_DIR"]) / "pool.sock", ("status",))


def pool_tree(pid: int) -> list[int]:
    from tinker_exp.pool.host import descendant_pids

    return [pid, *descendant_pids(pid)]


KILLED_AFTER_SENDING = """
import os, runpy, signal
from tinker_exp.pool import client
sent = client.Lease.train_run


def train_run(self, *args, **kwargs):  # its check answered and its record written: dies as soon as its run is sent
    self.follow = lambda: os.kill(os.getpid(), signal.SIGKILL)
    return sent(self, *args, **kwargs)


client.Lease.train_run = train_run
runpy.run_module("tinker_exp", run_name="__main__", alter_sys=True)
"""
"""The real CLI (its run dir's lock, its record, its lease, its run sent), SIGKILLed right after `Lease.train_run`
sent the run: before anything comes back, before the pool marks the run dir's lock as its own."""


def test_a_client_killed_right_after_sending_its_run_leaves_the_pool_free_and_the_next_run_served(pool, cosine_trunk, tmp_path):
    """The pool sees the connection go while it takes the run up (queued, or starting it): the run is ended before
    it trains (or stopped as on SIGTERM), the lease is freed, nothing writes into the run dir any more (a rerun may
    take it at once), and the next run trains exactly as the cold run of its command."""
    from tinker_exp.train.rundir_lock import RunDirLock

    killed_dir = tmp_path / "killed"
    client = subprocess.run([sys.executable, "-c", KILLED_AFTER_SENDING, *LONG_RUN, f"hydra.run.dir={killed_dir}"], cwd=REPO,
                            env=environment(pool), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert client.returncode == -signal.SIGKILL, client.stderr[-3000:]
    assert (killed_dir / "tinker_exp.log").exists()  # its record written (the check passed) before its run was sent
    # 2000 steps take minutes: the pool is free well before unless the killed client's run went on training.
    wait_until(lambda: pool_status(pool)["holder"] is None, 120, "the pool still lends its workers to the killed client")
    assert len(metrics_rows(killed_dir)) < 2000
    with RunDirLock(killed_dir):  # no one writes there any more: a rerun takes the dir at once
        pass

    run_dir = tmp_path / "next"
    warm(pool, *COSINE_TRUNK, f"hydra.run.dir={run_dir}")
    assert without_timings(metrics_rows(run_dir)) == without_timings(metrics_rows(cosine_trunk[0]))


RL = ["env=digits", "loss=importance_sampling", "trainer.steps=2"]
"""test_pool's RL command: its own group (TinkerActorRolloutRefWorker)."""


def test_an_rl_run_after_a_warm_run_killed_mid_run_is_the_cold_rl_run(pool, ray_address, tmp_path):
    """A warm SFT run SIGKILLed between its steps (or inside one), then an RL run on the same pool: it waits for the
    killed run's end, frees the SFT group, builds its own and trains exactly as a cold RL run (rewards and losses)."""
    killed = subprocess.Popen([sys.executable, "-m", "tinker_exp", *LONG_RUN, f"hydra.run.dir={tmp_path / 'killed'}"], cwd=REPO,
                              env=environment(pool), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_until(lambda: len(metrics_rows(tmp_path / "killed")) >= 2, 300, "the warm run never logged 2 steps", killed)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
    finally:
        killed.kill()

    cold(ray_address, *RL, f"hydra.run.dir={tmp_path / 'cold'}")
    result = warm(pool, *RL, f"hydra.run.dir={tmp_path / 'warm'}")
    assert "pool: no kept group fits this run" in result.stdout and "group built" in result.stdout
    rows = without_timings(metrics_rows(tmp_path / "cold"))
    assert [row["train/step"] for row in rows] == [0, 1] and "train/reward" in rows[0]
    assert without_timings(metrics_rows(tmp_path / "warm")) == rows


SEED_SWEEP = ["-m", "hydra/launcher=local", "hydra.launcher.max_parallel=1", "lora=r8", "trainer.steps=3", "logger=none", "trainer.seed=0,7"]
"""Two points, one at a time: on the sweep's own pool the second job (seed 7) is a seed change on a warm group, which
builds its engine again from the model dir (the seed draws LoRA's initial matrices)."""


@pytest.mark.real  # a sweep with its own pool (its own Ray cluster and workers)
def test_a_local_sweeps_second_job_on_its_pool_is_its_cold_point_and_a_seed_change_rebuilds_exactly(ray_address, tmp_path):
    """The same 2-point sweep cold (backend.pool=none) and on the sweep's pool: each point's rows and LoRA adapter are
    the cold point's, to the bit; the second job ran on the warm pool with another seed than the group's build."""
    cold_sweep = run_cli(*SEED_SWEEP, "backend.pool=none", f"hydra.sweep.dir={tmp_path / 'cold'}", env={"RAY_ADDRESS": ray_address}, timeout=600)
    assert cold_sweep.returncode == 0, cold_sweep.stderr[-3000:]
    warm_sweep = run_cli(*SEED_SWEEP, f"hydra.sweep.dir={tmp_path / 'warm'}", env={"TINKER_EXP_POOL": "auto", "RAY_ADDRESS": None}, timeout=600)
    assert warm_sweep.returncode == 0, warm_sweep.stdout[-2000:] + warm_sweep.stderr[-3000:]
    output = warm_sweep.stdout + warm_sweep.stderr
    assert "pool: 1 warm pool(s) for this sweep's jobs" in output and "pool: the sweep's 1 pool(s) ended" in output, output[-3000:]
    for point in ("0", "1"):
        said = (tmp_path / "warm" / point / "tinker_exp.log").read_text()
        assert "pool: training on the warm workers of" in said or "pool: training on the workers just built" in said, said
        assert "warm workers" not in (tmp_path / "cold" / point / "tinker_exp.log").read_text()
        cold_rows, warm_rows = (without_timings(metrics_rows(tmp_path / side / point)) for side in ("cold", "warm"))
        assert len(cold_rows) == 3 and warm_rows == cold_rows, point
        adapter = "adapter/adapter_model.safetensors"
        assert (tmp_path / "warm" / point / adapter).read_bytes() == (tmp_path / "cold" / point / adapter).read_bytes(), point
    # The seed draws LoRA's matrices (the two points' adapters differ): a warm job that kept the first seed's would differ.
    assert (tmp_path / "cold" / "0" / adapter).read_bytes() != (tmp_path / "cold" / "1" / adapter).read_bytes()


DASHBOARD_PORT = 8265
"""Ray's dashboard (its HTTP server and job-submission API) listens here when it runs."""


def listening_ports(pids: list[int]) -> set[int]:
    """The TCP ports that these processes listen on (Linux's /proc: their sockets' inodes in /proc/net/tcp*)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = fd.readlink().name
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # ended meanwhile
        return ""


def test_the_pools_ray_runs_no_dashboard(pool):
    """Ray's dashboard (a job-submission API any local user can reach) is off: no process of the pool's tree listens
    on its port, and Ray's dashboard process, which include_dashboard=False still starts (its usage stats only,
    `--modules-to-load=UsageStatsHead`), listens on nothing; the check sees the ports the pool's Ray does listen on."""
    tree = pool_tree(pool_status(pool)["pid"])
    commands = {pid: command_line(pid) for pid in tree}
    assert any("raylet" in command for command in commands.values()), commands
    ports = listening_ports(tree)
    assert ports and DASHBOARD_PORT not in ports, ports
    for pid, command in commands.items():
        if "dashboard/dashboard.py" in command:
            assert "--modules-to-load=UsageStatsHead" in command and listening_ports([pid]) == set(), command
