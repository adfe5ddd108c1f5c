"""One process per run dir (tinker_exp/train/rundir_lock.py): the liveness rules on their own, then real CLI
processes on one run dir. The holder is the real CLI with FakeWorkers (tests/fake_cli.py) held at a step by a gate
file, so no Ray is needed; the second process is a dry run or another fake CLI run."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import environment, metrics_rows, run_cli, run_fake_cli, start_fake_cli, wait_until
from tinker_exp.train import rundir_lock
from tinker_exp.train.rundir_lock import LOCK_FILE, STALE_AFTER_S, Holder, RunDirLock, RunDirInUse, process_started, takeover_reason

NO_SLURM = {"SLURM_JOB_ID": None, "SLURM_RESTART_COUNT": None}
HOST = socket.gethostname()


def holder(**fields) -> Holder:
    base = dict(host="node-a", pid=1234, started=555, since="2026-12-01 08:00:00 UTC", token="t-old")
    return Holder(**{**base, **fields})


ME = holder(host="node-b", pid=99, started=777, token="t-me")


# --- the rules, pure ---------------------------------------------------------------------------------------------

def test_another_hosts_lock_is_taken_over_only_once_its_heartbeat_is_stale():
    never_asked = lambda pid: pytest.fail("another host's pid is not looked up here")  # noqa: E731
    assert takeover_reason(holder(), ME, 5.0, never_asked) is None
    assert takeover_reason(holder(), ME, STALE_AFTER_S - 1, never_asked) is None
    stale = STALE_AFTER_S + 1
    assert takeover_reason(holder(), ME, stale, never_asked) == f"no heartbeat for {stale:.0f} s (> {STALE_AFTER_S:.0f} s)"


def test_this_hosts_lock_is_taken_over_when_its_pid_is_gone_or_reused_whatever_its_heartbeat():
    here = holder(host="node-b")
    assert takeover_reason(here, ME, 1.0, {1234: 555}.get) is None  # alive, the same process
    assert takeover_reason(here, ME, 10 * STALE_AFTER_S, {1234: 555}.get) is None  # alive, only stopped (SIGSTOP)
    assert takeover_reason(here, ME, 1.0, {}.get) == "pid 1234 is gone"
    assert takeover_reason(here, ME, 1.0, {1234: 556}.get) == "pid 1234 is another process now"
    assert takeover_reason(holder(host="node-b", started=None), ME, 1.0, {1234: 556}.get) is None  # no start time: alive


def test_a_requeued_slurm_job_takes_over_its_earlier_start_anywhere():
    alive = {1234: 555}.get
    first = holder(slurm_job_id="42", slurm_restarts=0)
    requeued = holder(host="node-b", slurm_job_id="42", slurm_restarts=1, token="t-me")
    assert takeover_reason(first, requeued, 1.0, alive) == "Slurm requeued job 42 (restart 0 -> 1)"
    assert takeover_reason(holder(host="node-b", slurm_job_id="42"), requeued, 1.0, alive) is not None  # same host, alive
    assert takeover_reason(first, holder(host="node-b", slurm_job_id="42", slurm_restarts=0), 1.0, alive) is None
    assert takeover_reason(holder(slurm_job_id="42", slurm_restarts=2), requeued, 1.0, alive) is None  # a later start holds it
    assert takeover_reason(holder(slurm_job_id="41"), requeued, 1.0, alive) is None  # another job


def test_process_started_tells_a_live_process_from_a_dead_or_zombie_one():
    assert process_started(os.getpid()) == process_started(os.getpid()) is not None
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    assert process_started(child.pid) not in (None, process_started(os.getpid()))
    child.kill()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet waited for: a zombie
    assert process_started(child.pid) is None
    child.wait()
    assert process_started(child.pid) is None


def test_a_takeover_that_finds_the_lock_changed_hands_puts_it_back(tmp_path):
    """Two contenders judged one stale lock; the first took it over; the second's late move must not remove it."""
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder(token="t-new").__dict__))
    late = RunDirLock(tmp_path, environment(NO_SLURM))
    assert late._remove_stale(holder(token="t-old")) is False
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "t-new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]


def test_an_unreadable_lock_is_refused_while_fresh_and_taken_over_once_stale(tmp_path):
    lock = tmp_path / LOCK_FILE
    lock.write_text("")  # as a holder leaves it between creating the file and writing its line
    with pytest.raises(RunDirInUse, match=f"is held by {re.escape(str(lock))}, which is not readable"):
        RunDirLock(tmp_path, environment(NO_SLURM)).acquire()
    os.utime(lock, (time.time() - STALE_AFTER_S - 60,) * 2)
    with RunDirLock(tmp_path, environment(NO_SLURM)) as taken:
        assert taken.holds()


def test_a_lock_is_released_on_exit_and_refused_while_held(tmp_path):
    with RunDirLock(tmp_path, environment(NO_SLURM)) as held:
        assert held.holds()
        with pytest.raises(RunDirInUse, match=rf"is held by host {re.escape(HOST)}, pid {os.getpid()}, since "):
            RunDirLock(tmp_path, environment(NO_SLURM)).acquire()
        assert held.holds()
    assert not (tmp_path / LOCK_FILE).exists()


def test_the_heartbeat_refreshes_the_lock_files_mtime(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir_lock, "HEARTBEAT_S", 0.05)
    with RunDirLock(tmp_path, environment(NO_SLURM)):
        lock = tmp_path / LOCK_FILE
        os.utime(lock, (1, 1))
        wait_until(lambda: lock.stat().st_mtime > time.time() - 60, 30, "the heartbeat never touched the lock")


def test_a_holder_whose_lock_was_taken_over_stops_its_heartbeat_and_leaves_the_new_lock(tmp_path, monkeypatch, caplog):
    """A requeued job took the dir over while the earlier start still runs: the earlier one's release keeps it."""
    monkeypatch.setattr(rundir_lock, "HEARTBEAT_S", 0.05)
    held = RunDirLock(tmp_path, environment(NO_SLURM))
    held.acquire()
    try:
        newer = json.dumps(holder(host="node-c", token="t-requeued").__dict__) + "\n"
        (tmp_path / LOCK_FILE).write_text(newer)
        wait_until(lambda: not held._heartbeat.is_alive(), 30, "the heartbeat never noticed")
    finally:
        held.release()
    assert (tmp_path / LOCK_FILE).read_text() == newer
    assert "this run no longer holds its run dir (the lock is held by host node-c, pid 1234, since" in caplog.text


def contend(run_dir: Path, start, results, release) -> None:
    start.wait()
    try:
        with RunDirLock(run_dir, environment(NO_SLURM)):
            results.put("won")
            release.wait()
    except RunDirInUse as e:
        results.put(str(e))


def test_of_processes_taking_over_one_stale_lock_at_once_exactly_one_wins(tmp_path):
    """Exclusive creation under contention (the narrow rename race itself: the test above, deterministically)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    write_lock(tmp_path, STALE_AFTER_S + 60, host="other-node", pid=4321)
    start, release, results = context.Barrier(6), context.Event(), context.Queue()
    contenders = [context.Process(target=contend, args=(tmp_path, start, results, release)) for _ in range(6)]
    for process in contenders:
        process.start()
    try:
        outcomes = [results.get(timeout=120) for _ in contenders]
    finally:
        release.set()
        for process in contenders:
            process.join(60)
    assert outcomes.count("won") == 1, outcomes
    assert all("is held by host " + HOST in outcome for outcome in outcomes if outcome != "won"), outcomes
    assert not list(tmp_path.iterdir())


# --- real processes on one run dir ---------------------------------------------------------------------------------

def snapshot(run_dir: Path) -> dict[str, tuple]:
    """Every file's name, size and mtime; the lock's content instead of its mtime (the holder's heartbeat)."""
    return {
        str(p.relative_to(run_dir)): (p.stat().st_size, p.read_text() if p.name == LOCK_FILE else p.stat().st_mtime_ns)
        for p in sorted(run_dir.rglob("*")) if p.is_file()
    }  # fmt: skip


def gated_run(run_dir: Path, gate: Path, steps: int = 4, gate_step: int = 2, env: dict | None = None):
    """The real CLI with FakeWorkers, held before step `gate_step` until `gate` exists; a checkpoint every 2. Its own
    process (forked from the CLI zygote), driven as a Popen."""
    return start_fake_cli(
        f"trainer.steps={steps}", "checkpoint.every_steps=2", "logger=none", f"hydra.run.dir={run_dir}",
        env={**NO_SLURM, "FAKE_GATE_STEP": str(gate_step), "FAKE_GATE_FILE": str(gate), **(env or {})}, default_sigint=True,
    )  # fmt: skip


def wait_at_gate(run_dir: Path, process: subprocess.Popen, gate_step: int = 2) -> None:
    """Until the holder waits at its gate, its last log line (the checkpoint before the gate) written."""
    log = run_dir / "tinker_exp.log"
    wait_until(lambda: len(metrics_rows(run_dir)) >= gate_step and log.exists() and f"step_{gate_step:08d}" in log.read_text(),
               180, "the holder never reached its gate", process)  # fmt: skip


def fake_cli(run_dir: Path, steps: int, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_fake_cli(f"trainer.steps={steps}", "checkpoint.every_steps=2", "logger=none", f"hydra.run.dir={run_dir}",
                        env={**NO_SLURM, **(env or {})})  # fmt: skip


IN_USE = (r"tinker_exp: run dir in use: {dir} is held by host {host}, pid {pid}, since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC: "
          "wait for it to end, or use another run dir")


@pytest.mark.parametrize("second", ["dry run", "training run"])
def test_a_second_process_on_a_held_run_dir_exits_2_with_one_line_and_writes_nothing(tmp_path, second):
    run_dir, gate = tmp_path / "run", tmp_path / "go"
    first = gated_run(run_dir, gate)
    try:
        wait_at_gate(run_dir, first)
        before = snapshot(run_dir)
        assert LOCK_FILE in before and ".hydra/config.yaml" in before
        if second == "dry run":
            result = run_cli("trainer.steps=4", "dry_run=true", f"hydra.run.dir={run_dir}", env=NO_SLURM)
        else:
            result = fake_cli(run_dir, 4)
        assert result.returncode == 2, result.stderr[-3000:]
        lines = result.stderr.strip().splitlines()
        one_line = IN_USE.format(dir=re.escape(str(run_dir)), host=re.escape(HOST), pid=first.pid)
        assert len(lines) == 1 and re.fullmatch(one_line, lines[0]), lines
        assert snapshot(run_dir) == before
        gate.touch()
        _, stderr = first.communicate(timeout=180)
    finally:
        first.kill()
    assert first.returncode == 0, stderr[-3000:]
    assert [row["train/step"] for row in metrics_rows(run_dir)] == [0, 1, 2, 3]
    assert not (run_dir / LOCK_FILE).exists()


def test_a_sigkilled_holders_lock_is_taken_over_by_the_next_run(tmp_path):
    run_dir, gate = tmp_path / "run", tmp_path / "go"
    first = gated_run(run_dir, gate)
    try:
        wait_at_gate(run_dir, first)
        first.kill()
        first.wait(timeout=60)
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == first.pid
        rerun = fake_cli(run_dir, 4)
    finally:
        first.kill()
        first.wait()
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"run dir lock of host {HOST}, pid {first.pid}, since " in rerun.stdout
    assert f"taken over: pid {first.pid} is gone" in rerun.stdout
    assert f"resuming from {run_dir / 'checkpoints' / 'step_00000002'} at step 2" in rerun.stdout
    assert [row["train/step"] for row in metrics_rows(run_dir)] == [0, 1, 2, 3]
    assert not (run_dir / LOCK_FILE).exists()


def write_lock(run_dir: Path, age_s: float, **fields) -> Path:
    """A lock file as another process left it, its heartbeat `age_s` old."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / LOCK_FILE
    lock.write_text(json.dumps(holder(**fields).__dict__) + "\n")
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_another_hosts_fresh_lock_is_refused_and_its_stale_one_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    lock = write_lock(run_dir, 5.0, host="other-node", pid=4321)
    before = snapshot(run_dir)
    refused = run_cli("dry_run=true", f"hydra.run.dir={run_dir}", env=NO_SLURM)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        f"tinker_exp: run dir in use: {run_dir} is held by host other-node, pid 4321, since 2026-12-01 08:00:00 UTC: "
        "wait for it to end, or use another run dir"
    ]
    assert snapshot(run_dir) == before
    os.utime(lock, (time.time() - STALE_AFTER_S - 60, time.time() - STALE_AFTER_S - 60))
    taken = run_cli("dry_run=true", f"hydra.run.dir={run_dir}", env=NO_SLURM)
    assert taken.returncode == 0, taken.stderr
    assert "run dir lock of host other-node, pid 4321, since 2026-12-01 08:00:00 UTC taken over: no heartbeat for" in taken.stdout
    assert (run_dir / "plan.json").exists() and not lock.exists()
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(LOCK_FILE)]  # nor the stale one moved aside


def test_a_requeued_slurm_job_takes_over_its_earlier_starts_fresh_lock(tmp_path):
    run_dir = tmp_path / "run"
    write_lock(run_dir, 1.0, host="other-node", pid=4321, slurm_job_id="4242", slurm_restarts=0)
    same_start = run_cli("dry_run=true", f"hydra.run.dir={run_dir}", env={"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0"})
    assert same_start.returncode == 2, same_start.stderr
    assert "is held by host other-node, pid 4321, Slurm job 4242, since 2026-12-01 08:00:00 UTC" in same_start.stderr
    requeued = run_cli("dry_run=true", f"hydra.run.dir={run_dir}", env={"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"})
    assert requeued.returncode == 0, requeued.stderr
    assert "taken over: Slurm requeued job 4242 (restart 0 -> 1)" in requeued.stdout
    assert json.loads((run_dir / "job.json").read_text())["slurm"]["restart_count"] == "1"
    assert not (run_dir / LOCK_FILE).exists()


def test_the_lock_is_released_after_a_failed_run_and_after_sigterm(tmp_path):
    run_dir, gate = tmp_path / "run", tmp_path / "go"
    run_dir.mkdir()  # there before the command (a dir made for a refused command is removed: test_cli_resume)
    failed = run_cli("resume=must", "dry_run=true", f"hydra.run.dir={run_dir}", env=NO_SLURM)
    assert failed.returncode == 2 and "resume=must, but there is no checkpoint" in failed.stderr, failed.stderr
    assert run_dir.exists() and not (run_dir / LOCK_FILE).exists()
    first = gated_run(run_dir, gate)
    try:
        wait_at_gate(run_dir, first)
        first.terminate()
        _, stderr = first.communicate(timeout=180)
    finally:
        first.kill()
    assert first.returncode == 143, stderr[-3000:]
    assert not (run_dir / LOCK_FILE).exists()
    assert fake_cli(run_dir, 4).returncode == 0  # and the next run gets the dir
