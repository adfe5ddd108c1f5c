"""Slurm's view of a job: its state in the accounting, and when an ended state can be believed. Pure Python."""

from __future__ import annotations

import subprocess
import time
from typing import Callable, Mapping

# Slurm states of a job that may still write its result. A requeued job passes through REQUEUED,
# PENDING and RUNNING again; PREEMPTED and FAILED can show for a moment on the way (hence the settling).
ACTIVE_STATES = {
    "PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RUNNING", "COMPLETING",
    "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING", "STAGE_OUT", "UNKNOWN",
}  # fmt: skip


def slurm_verdict(
    result_written: Callable[[], bool],
    state: Callable[[], str],
    poll_s: float = 5.0,
    settle_s: float = 20.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str | None:
    """None once the result is written; else Slurm's end state, taken only once it has held for `settle_s`.

    So a requeued job is waited for again rather than reported from a state it passed through on the way
    (submitit's own wait takes the first final-looking state it sees).
    """
    ended_since = None
    while not result_written():
        now, current = clock(), state()
        if current in ACTIVE_STATES:
            ended_since = None
        elif ended_since is None:
            ended_since = now
        elif now - ended_since >= settle_s:
            return current
        sleep(poll_s)
    return None


SLURM_CALL_TIMEOUT_S = 60.0
"""Every Slurm command we run is bounded: a loaded slurmctld or slurmdbd must never hang the submitting process."""


def slurm_state(job_id: str, timeout_s: float = SLURM_CALL_TIMEOUT_S, env: Mapping[str, str] | None = None) -> str:
    """The job's state: squeue's while the job is in the queue (a requeued job is PENDING there again, whatever
    its last start ended with), else the accounting's: CANCELLED ("CANCELLED by 0" -> CANCELLED), TIMEOUT, ...

    UNKNOWN (an active state: asked again later) when a command fails or does not answer in time."""
    queued = _run(["squeue", "--noheader", "--jobs", job_id, "--format", "%T"], timeout_s, env)
    if queued is None:
        return "UNKNOWN"
    if queued.returncode == 0 and queued.stdout.strip():
        return queued.stdout.split()[0]
    sacct = _run(["sacct", "--jobs", job_id, "--allocations", "--noheader", "--parsable2", "--format", "State"], timeout_s, env)
    lines = [line for line in sacct.stdout.splitlines() if line.strip()] if sacct is not None else []
    return lines[-1].split()[0] if sacct is not None and sacct.returncode == 0 and lines else "UNKNOWN"


def _run(command: list[str], timeout_s: float, env: Mapping[str, str] | None) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(command, capture_output=True, text=True, check=False, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return None


def cancel_slurm_jobs(job_ids: list[str], timeout_s: float = SLURM_CALL_TIMEOUT_S) -> bool:
    """One scancel for all of them; True once Slurm took it (False: it failed or did not answer in time)."""
    done = _run(["scancel", *job_ids], timeout_s, None)
    return done is not None and done.returncode == 0
