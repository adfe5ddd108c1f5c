"""Study workers: long-lived jobs that run an Optuna study's trials one after another, each asked from its storage.

Each trial is asked from the study's storage, as Optuna's own distributed model has it (many processes asking and
telling through one journal or database).

Pure Python (optuna; no torch, verl or ray). The Hydra side (optuna_sweeper.py) submits the worker jobs, runs each
trial in a worker as its own job would run (same run dir, same files, job number = trial number), and waits.

Who does what, so that nothing is run twice and nothing is lost:
- a worker asks (`take`) under a lock file in the sweep dir: the check "is a trial still wanted" and the ask are one
  step, so W workers never ask more than n_trials between them;
- a worker tells its own trial (complete, pruned, failed) and says it is alive every HEARTBEAT_S (`Heartbeat`);
- only the sweep's own process fails a trial whose worker is gone (`lose`): its job ended (scancel, kill -9, node
  failure) or its heartbeat stopped; it enqueues a retry (a new trial number with the same values) that the next
  free worker takes first, and runs from the lost trial's newest checkpoint (`retry_start`: a branch of its run dir),
  or from step 0 where it saved none;
- a worker that stops (its job requeued, cancelled) tells none of the trials it stopped and takes no new one: a
  requeued worker takes its trials back (`resumed`);
- a sweep that stops (Ctrl-C, SIGTERM) fails its running trials, cut off, and marks the study stopped before it
  cancels its workers (`stop_workers`: none asks a trial after that), and the same command continues those trials,
  each at its point in its run dir (tinker_exp/sweep/study.py `continue_cut_off`).

Work known up front (a PBT population's members) runs on the same machinery: each member is a trial enqueued in a
ledger of the sweep's (`items_study`, a journal file in the sweep dir) with its number as the one parameter ITEM, so
a worker claims a member as it asks a trial (under the same lock, never one claimed already), says it is alive by
the same heartbeat, and a member whose worker is gone is lost and enqueued again (`lose`) with the same number: it
runs again in its own run dir, from its newest checkpoint there.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import optuna
from optuna.trial import FrozenTrial, TrialState

from tinker_exp.sweep.study import RETRY_OF, open_storage, settled  # noqa: F401 (RETRY_OF, settled: the workers' names too)

WORKER_ATTR = "worker"
"""A running trial's system attribute: the Slurm job id of the worker that runs it."""
SEEN_ATTR = "worker_seen"
"""A running trial's system attribute: when its worker last said it is alive (time.time())."""
ASK_LOCK = "optuna.ask"
"""In the sweep dir: the lock file (`<this>.lock`) that makes a worker's check-and-ask one step."""
HEARTBEAT_S = 5.0
"""How often a worker writes SEEN_ATTR while its trial runs: one small write to the storage."""
STALE_S = 120.0
"""A running trial whose worker has not been seen for this long is lost (a node gone while Slurm still says RUNNING);
well above HEARTBEAT_S, as a loaded journal file or database can be slow to take a write."""
MAX_RETRIES = 2
"""Times a lost trial is run again: a trial that kills its worker each time (out of memory) stops after these."""
WAIT_S = 2.0
"""How often an idle worker looks again while the last trials run elsewhere (one of them may be lost and retried)."""
STOPPED_ATTR = "sweep_stopped"
"""The study's system attribute, True while its sweep is stopped (Ctrl-C, SIGTERM, an error): no worker asks a trial.

A worker lives on until Slurm kills it, KillWait after the scancel (`take` asks nothing then). Set False as a sweep
submits its workers."""
ITEM = "item"
"""A work item's one parameter in a ledger of work known up front (`items_study`): its number (a member's)."""
ITEMS_JOURNAL = "items.journal"
"""In the sweep dir: the ledger of work items (a population's members), one Optuna study per launch of the sweep."""


def retries_before(trials: Sequence[FrozenTrial], trial: FrozenTrial) -> int:
    """How many times the values of `trial` have been run before it (the chain of RETRY_OF back to the first)."""
    by_number = {t.number: t for t in trials}
    count, current = 0, trial
    while RETRY_OF in current.user_attrs and current.user_attrs[RETRY_OF] in by_number:
        count, current = count + 1, by_number[current.user_attrs[RETRY_OF]]
    return count


@contextlib.contextmanager
def ask_lock(sweep_dir: Path) -> Iterator[None]:
    """Held while a worker checks what is wanted and asks: Optuna's own O_EXCL file lock.

    It works on NFS; its grace period frees a lock whose holder was killed."""
    from optuna.storages.journal import JournalFileOpenLock

    lock = JournalFileOpenLock(str(sweep_dir / ASK_LOCK))
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def take(study: optuna.Study, n_trials: int, ask: Callable[[], optuna.Trial], worker: str, sweep_dir: Path) -> optuna.Trial | None | bool:
    """The next trial for this worker (a retry waiting first, else a new one), marked as its.

    None when the study has its n_trials or its sweep has stopped (the worker may end); False when every trial still
    wanted runs elsewhere (look again later)."""
    with ask_lock(sweep_dir):
        trials = study.get_trials(deepcopy=False)
        done, running = len(settled(study)), [t for t in trials if t.state == TrialState.RUNNING]
        waiting = any(t.state == TrialState.WAITING for t in trials)
        if done >= n_trials or study._storage.get_study_system_attrs(study._study_id).get(STOPPED_ATTR):
            return None
        if not waiting and done + len(running) >= n_trials:
            return False
        trial = ask()
        trial.storage.set_trial_system_attr(trial._trial_id, WORKER_ATTR, worker)
        trial.storage.set_trial_system_attr(trial._trial_id, SEEN_ATTR, time.time())
        return trial


class Heartbeat:
    """Within: the worker's trial is marked seen every `every_s` (a thread), so the sweep sees its worker alive.

    The sweep can so tell a live worker from one whose node is gone."""

    def __init__(self, trial: optuna.Trial, every_s: float = HEARTBEAT_S) -> None:
        self.trial, self.every_s = trial, every_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="study-worker-heartbeat", daemon=True)

    def _beat(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                self.trial.storage.set_trial_system_attr(self.trial._trial_id, SEEN_ATTR, time.time())
            except Exception:  # told meanwhile (finished trials take no attributes), or the storage hiccuped
                return

    def __enter__(self) -> "Heartbeat":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stopped.set()
        self.thread.join()


def work(
    study: optuna.Study,
    n_trials: int,
    ask: Callable[[], optuna.Trial],
    run: Callable[[optuna.Trial], None],
    worker: str,
    sweep_dir: Path,
    wait_s: float = WAIT_S,
    stopping: Callable[[], bool] = lambda: False,
) -> int:
    """A worker's life: take a trial, run it (`run` tells the study what it came to); how many trials it ran.

    Until the study has its n_trials, or until the worker is `stopping` (requeued, cancelled: it takes no new trial)."""
    ran = 0
    while not stopping():
        trial = take(study, n_trials, ask, worker, sweep_dir)
        if trial is None:
            return ran
        if trial is False:
            time.sleep(wait_s)
            continue
        with Heartbeat(trial):
            run(trial)
        ran += 1
    return ran


def stop_workers(study: optuna.Study, sweep_dir: Path) -> None:
    """Mark the study stopped and cut its running trials off, before the sweep cancels its workers.

    Under the ask lock: the study marked stopped (a worker asks no trial after it, `take`) and every running trial
    failed without an error (cut off: the same command continues it), so that a trial whose training dies of the
    scancel is not told a failure of its own (its worker's tell is refused). A retry or continuation not started
    stays WAITING."""
    with ask_lock(sweep_dir):
        study._storage.set_study_system_attr(study._study_id, STOPPED_ATTR, True)
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            try:
                study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass  # told by its worker just now


def retry_start(study: optuna.Study, trial: Any) -> list[str]:
    """The overrides that start `trial` where the lost trial it retries left off; [] for a trial that is no retry.

    `branch.from=<its run dir>` when that run saved a usable checkpoint before its last step (the retry trains on from
    the newest one in its own run dir, bitwise as the lost trial would have: docs/branching.md), else none (from step
    0)."""
    from tinker_exp.train.start import branch_step

    lost_number = trial.user_attrs.get(RETRY_OF)
    if lost_number is None:
        return []
    lost = next((t for t in study.get_trials(deepcopy=False) if t.number == lost_number), None)
    run_dir = lost.user_attrs.get("run_dir") if lost is not None else None
    if not run_dir or branch_step(Path(run_dir)) is None:
        return []
    return [f"branch.from={run_dir}"]


def resumed(study: optuna.Study, worker: str) -> list[optuna.Trial]:
    """The trials still RUNNING under this worker's job id: the job was requeued while it ran them.

    Requeued: a time limit, a preemption. Each is marked seen now and run again in its own run dir, which resumes from
    its checkpoint. One the sweep has meanwhile taken for lost (not seen for STALE_S while the job waited in the queue)
    is failed and retried by then, and not among these."""
    mine = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if t.system_attrs.get(WORKER_ATTR) == worker]
    for trial in mine:
        study._storage.set_trial_system_attr(trial._trial_id, SEEN_ATTR, time.time())
    return [optuna.trial.Trial(study, t._trial_id) for t in mine]


def lost(running: Sequence[FrozenTrial], ended_workers: dict[str, str], now: float, stale_s: float = STALE_S) -> list[tuple[FrozenTrial, str]]:
    """Running trials whose worker is gone, each with why.

    Its job ended (`ended_workers`: job id -> Slurm's end state), or it was not seen for `stale_s`."""
    gone = []
    for trial in running:
        worker, seen = trial.system_attrs.get(WORKER_ATTR), trial.system_attrs.get(SEEN_ATTR)
        if worker is None:
            continue  # asked by a job-per-trial sweep: its own launcher follows it
        if worker in ended_workers:
            gone.append((trial, f"its worker job {worker} ended ({ended_workers[worker]}) while it ran"))
        elif seen is not None and now - seen > stale_s:
            gone.append((trial, f"its worker job {worker} was not seen for {now - seen:.0f} s (node lost?)"))
    return gone


def lose(study: optuna.Study, trial: FrozenTrial, why: str, sweep_dir: Path, max_retries: int = MAX_RETRIES,
         label: Callable[[FrozenTrial], str] | None = None) -> str:  # fmt: skip
    """Fail a trial whose worker is gone and, unless its values ran `max_retries` times already, enqueue a retry.

    The retry: a new trial of the same values, in its own run dir, from the lost trial's newest checkpoint
    (`retry_start`); a work item's: the same item (`items_study`). One line saying what was done, the trial named by
    `label` (default `trial N`). A worker that tells the trial first wins (the storage keeps the first end of a trial);
    then nothing is retried."""
    named = label(trial) if label else f"trial {trial.number}"
    storage = study._storage  # the study's own storage object: the same calls a worker makes through its trial
    with ask_lock(sweep_dir):  # the retry's number is the next one: no worker asks meanwhile
        retry_count = retries_before(study.get_trials(deepcopy=False), trial)
        try:
            storage.set_trial_user_attr(trial._trial_id, "error", f"lost: {why}")
            storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            return f"{named}: told by its worker after all"
        if retry_count >= max_retries:
            return f"{named} failed: {why}; its values ran {retry_count + 1} times, not retried"
        study.enqueue_trial(dict(trial.params), user_attrs={RETRY_OF: trial.number})
        retry = max(t.number for t in study.get_trials(deepcopy=False))
    return f"{named} failed: {why}; retried as trial {retry}"


def items_study(sweep_dir: Path, count: int, prefix: str) -> optuna.Study:
    """A new ledger of `count` work items (trials enqueued with ITEM = 0..count-1) in the sweep dir's ITEMS_JOURNAL.

    Named `<prefix>-<n>`: one a launch of the sweep (a continued population starts its members anew: each resumes in its
    own run dir, or says it is complete), the earlier ones kept as they were."""
    storage = open_storage(f"journal://{sweep_dir / ITEMS_JOURNAL}")
    launches = len(optuna.get_all_study_names(storage)) if (sweep_dir / ITEMS_JOURNAL).exists() else 0
    study = optuna.create_study(study_name=f"{prefix}-{launches}", storage=storage)
    for item in range(count):
        study.enqueue_trial({ITEM: item})
    return study


def ask_item(study: optuna.Study, count: int) -> optuna.Trial:
    """The next enqueued work item, as `take` asks it (a lost item's retry is enqueued too, with its number)."""
    from optuna.distributions import IntDistribution

    trial = study.ask({ITEM: IntDistribution(0, count - 1)})
    if "fixed_params" not in trial.storage.get_trial_system_attrs(trial._trial_id):  # only `take` asks, and only enqueued ones
        study.tell(trial, state=TrialState.FAIL)
        raise RuntimeError(f"{ITEMS_JOURNAL}: trial {trial.number} asked with no work item waiting")
    return trial


def workers_of_earlier_launches(sweep_dir: Path, prefix: str) -> list[str]:
    """The worker jobs (Slurm ids) that ran items of earlier launches of this sweep and never told them.

    Such jobs are left by a sweep killed while its workers ran. Its items are failed here (cut off); the caller cancels
    the jobs, so that no member runs twice (the new launch resumes it in its run dir)."""
    if not (sweep_dir / ITEMS_JOURNAL).exists():
        return []
    storage = open_storage(f"journal://{sweep_dir / ITEMS_JOURNAL}")
    workers = []
    for name in optuna.get_all_study_names(storage):
        if name.startswith(f"{prefix}-"):
            study = optuna.load_study(study_name=name, storage=storage)
            for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING)):
                if WORKER_ATTR in trial.system_attrs:
                    workers.append(trial.system_attrs[WORKER_ATTR])
                study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
    return sorted(set(workers))


def lost_lock_freed(run_dir: Path, wait_s: float = 150.0, poll_s: float = 5.0) -> bool:
    """Before a lost work item (a member) runs again in its own run dir: wait, bounded, until its run dir lock is free.

    Wait until the run dir lock its lost run left there (kill -9 and a lost node leave it) may be taken over, as the
    run's own lock judges it (at once on the same host, once its heartbeat is 120 s old on another:
    tinker_exp/train/rundir_lock.py). True when it may (or there is none); False when a live holder keeps it, which the
    run then names."""
    from tinker_exp.train.rundir_lock import LOCK_FILE, Holder, process_started, read_holder, takeover_reason

    deadline = time.monotonic() + wait_s
    while True:
        found = read_holder(run_dir / LOCK_FILE)
        if found is None or found[0] is None or takeover_reason(found[0], Holder.me(), found[1], process_started) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
