"""Slurm's view of a job: its state in the accounting, and when an ended state can be believed. Pure Python."""

from __future__ import annotations

import subprocess
import time
from typing import Callable, Mapping, Sequence

# Slurm states of a job that may still write its result. A requeued job passes through REQUEUED,
# PENDING and RUNNING again; PREEMPTED and FAILED can show for a moment on the way (hence the settling).
ACTIVE_STATES = {
    "PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RUNNING", "COMPLETING",
    "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING", "STAGE_OUT", "UNKNOWN",
}  # fmt: skip


class Settling:
    """When one job's ended-looking Slurm state can be believed: once it has held for `settle_s`.

    A requeued job passes through PREEMPTED or FAILED on its way back to PENDING; submitit's own wait takes the first
    one."""

    def __init__(self, settle_s: float = 20.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.settle_s, self.clock = settle_s, clock
        self.ended_since: float | None = None

    def verdict(self, state: str) -> str | None:
        """Slurm's end state once it has held long enough, else None (still active, or not settled yet)."""
        now = self.clock()
        if state in ACTIVE_STATES:
            self.ended_since = None
        elif self.ended_since is None:
            self.ended_since = now
        elif now - self.ended_since >= self.settle_s:
            return state
        return None


class Verdicts:
    """Jobs' verdicts: None once a job's result is written; else Slurm's end state, once it has held for `settle_s`.

    Held for `settle_s` so a requeued job is waited for again rather than reported from a state it passed through on the
    way. Settled side by side: asking for one job's looks at every job still undecided each poll (their states in one
    call), so jobs that ended without a result settle together, not `settle_s` one after another."""

    def __init__(
        self,
        result_written: Mapping[str, Callable[[], bool]],
        states: Callable[[list[str]], Mapping[str, str]],
        poll_s: float = 5.0,
        settle_s: float = 20.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """`result_written`: job id -> whether its result is written; `states(job ids)`: their Slurm states."""
        self.result_written, self.states, self.poll_s, self.sleep = dict(result_written), states, poll_s, sleep
        self.settling = {job_id: Settling(settle_s, clock) for job_id in self.result_written}
        self.found: dict[str, str | None] = {}

    def of(self, job_id: str) -> str | None:
        """Job `job_id`'s verdict: None once its result is written, else its settled end state; waits for it."""
        while job_id not in self.found:
            pending = [j for j in self.result_written if j not in self.found]
            states = self.states(pending)
            for j in pending:
                if self.result_written[j]():
                    self.found[j] = None
                elif (ended := self.settling[j].verdict(states.get(j, "UNKNOWN"))) is not None:
                    self.found[j] = ended
            if job_id not in self.found:
                self.sleep(self.poll_s)
        return self.found[job_id]


SLURM_CALL_TIMEOUT_S = 60.0
"""Every Slurm command we run is bounded: a loaded slurmctld or slurmdbd must never hang the submitting process."""


def slurm_state(job_id: str, timeout_s: float = SLURM_CALL_TIMEOUT_S, env: Mapping[str, str] | None = None) -> str:
    """The job's state: squeue's while the job is in the queue, else the accounting's.

    A requeued job is PENDING in squeue again, whatever its last start ended with; the accounting's: CANCELLED
    ("CANCELLED by 0" -> CANCELLED), TIMEOUT, ...

    UNKNOWN (an active state: asked again later) when a command fails or does not answer in time."""
    queued = _run(["squeue", "--noheader", "--jobs", job_id, "--format", "%T"], timeout_s, env)
    if queued is None:
        return "UNKNOWN"
    if queued.returncode == 0 and queued.stdout.strip():
        return queued.stdout.split()[0]
    sacct = _run(["sacct", "--jobs", job_id, "--allocations", "--noheader", "--parsable2", "--format", "State"], timeout_s, env)
    lines = [line for line in sacct.stdout.splitlines() if line.strip()] if sacct is not None else []
    return lines[-1].split()[0] if sacct is not None and sacct.returncode == 0 and lines else "UNKNOWN"


def slurm_states(job_ids: Sequence[str], timeout_s: float = SLURM_CALL_TIMEOUT_S, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each job's state as `slurm_state` tells it, for many jobs with one squeue call.

    One sacct call too for the jobs no longer queued: what a sweeper waiting for any of its jobs asks at every poll."""
    if not job_ids:
        return {}
    states = {job_id: "UNKNOWN" for job_id in job_ids}
    queued = _run(["squeue", "--noheader", "--jobs", ",".join(job_ids), "--format", "%i %T"], timeout_s, env)
    if queued is None:
        return states
    # One id that left the queue makes squeue fail ("Invalid job id"); several: it lists those still there.
    if queued.returncode == 0 or len(job_ids) == 1:
        in_queue = dict(line.split()[:2] for line in queued.stdout.splitlines() if len(line.split()) >= 2)
    else:
        return states
    states.update((job_id, state) for job_id, state in in_queue.items() if job_id in states)
    gone = [job_id for job_id in job_ids if job_id not in in_queue]
    if gone:
        sacct = _run(["sacct", "--jobs", ",".join(gone), "--allocations", "--noheader", "--parsable2", "--format", "JobID,State"], timeout_s, env)
        if sacct is not None and sacct.returncode == 0:
            for line in sacct.stdout.splitlines():  # a job's last line is its newest start
                job_id, _, state = line.partition("|")
                if job_id in states and state.strip():
                    states[job_id] = state.split()[0]
    return states


def _run(command: list[str], timeout_s: float, env: Mapping[str, str] | None) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(command, capture_output=True, text=True, check=False, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return None


def cancel_slurm_jobs(job_ids: list[str], timeout_s: float = SLURM_CALL_TIMEOUT_S) -> bool:
    """One scancel for all of them; True once Slurm took it (False: it failed or did not answer in time)."""
    done = _run(["scancel", *job_ids], timeout_s, None)
    return done is not None and done.returncode == 0


LEAVE_QUEUE_S = 60.0
"""How long a study waits for the Slurm jobs it cancelled (of trials cut off) to leave the queue before it goes on."""


def left_queue(
    job_ids: Sequence[str], wait_s: float = LEAVE_QUEUE_S, poll_s: float = 1.0, states_of: Callable[[list[str]], dict[str, str]] | None = None,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
) -> list[str]:  # fmt: skip
    """Wait, bounded, until the jobs are no longer active in Slurm; those still active after `wait_s`.

    A cancelled job's processes take SIGTERM and stop within Slurm's KillWait. None returned: every one has left (a
    state Slurm does not tell counts as left)."""
    deadline = clock() + wait_s
    while True:
        states = (states_of or slurm_states)(list(job_ids))
        active = [job_id for job_id in job_ids if states[job_id] in ACTIVE_STATES and states[job_id] != "UNKNOWN"]
        if not active or clock() >= deadline:
            return active
        sleep(poll_s)
