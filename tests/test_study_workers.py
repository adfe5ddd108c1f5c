"""Study workers (hydra.launcher.workers=W): W Slurm jobs that each keep warm workers and run an Optuna study's trials
one after another, asked from the study's storage. The bookkeeping on a real journal file (pure, fast); the whole
thing on the suite's Slurm cluster: a worker killed with kill -9 mid-trial (journal), a worker requeued (journal),
Ctrl-C (PostgreSQL)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from helpers import REPO, environment, job_json, read_jsonl, requeue_at_time_limit, run_cli, squeue, wait_until
from tinker_exp.formats import read_json
from tinker_exp.sweep.study import finished, open_storage, recover
from tinker_exp.sweep.workers import RETRY_OF, SEEN_ATTR, WORKER_ATTR, lose, lost, resumed, retries_before, settled, take

SPACE = {"x": CategoricalDistribution([1, 2, 3, 4])}


def journal_study(tmp_path: Path) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(study_name="s", storage=open_storage(f"journal://{tmp_path / 'optuna.journal'}"))


# --- pure: what a worker asks, and what the sweep does with a trial whose worker is gone --------------------------------


def test_workers_ask_no_more_than_n_trials_a_lost_trial_is_retried_first_and_counted_once(tmp_path):
    """Two workers ask 3 trials: the third ask finds every wanted trial running (False, look again), none is asked
    past n_trials. Worker a's trial is lost (its job ended): failed with why, and its values enqueued as a new trial
    that the next ask takes before any new one; the lost trial does not count towards n_trials, its retry does. When
    the 3 have ended, a worker is told the study is done (None)."""
    study = journal_study(tmp_path)
    ask = lambda: study.ask(SPACE)  # noqa: E731
    first, second = take(study, 2, ask, "7_0", tmp_path), take(study, 2, ask, "7_1", tmp_path)
    assert take(study, 2, ask, "7_1", tmp_path) is False and len(study.trials) == 2
    frozen = {t.number: t for t in study.trials}
    assert frozen[0].system_attrs[WORKER_ATTR] == "7_0" and frozen[1].system_attrs[WORKER_ATTR] == "7_1"
    assert abs(frozen[0].system_attrs[SEEN_ATTR] - time.time()) < 60

    ((trial, why),) = lost(study.get_trials(states=(TrialState.RUNNING,)), {"7_0": "FAILED"}, time.time())
    assert trial.number == first.number and why == "its worker job 7_0 ended (FAILED) while it ran"
    assert lose(study, trial, why, tmp_path) == f"trial 0 failed: {why}; retried as trial 2"
    study.tell(second, 1.0)
    retry = take(study, 2, ask, "7_1", tmp_path)
    assert retry.number == 2 and retry.params == first.params and retry.user_attrs[RETRY_OF] == 0
    assert study.trials[0].state == TrialState.FAIL and study.trials[0].user_attrs["error"] == f"lost: {why}"
    assert [t.number for t in settled(study)] == [1] and len(finished(study)) == 2  # the lost one not counted
    study.tell(retry, 2.0)
    assert take(study, 2, ask, "7_1", tmp_path) is None and [t.number for t in settled(study)] == [1, 2]


def test_a_trial_not_seen_is_lost_its_retries_are_bounded_and_a_worker_that_tells_first_wins(tmp_path):
    """No heartbeat for longer than stale_s: lost (a node gone while Slurm says RUNNING); a trial seen just now, or
    asked by a job-per-trial sweep (no worker), is not. A retry of a retry is not retried past max_retries. A trial
    its worker told before the sweep took it for lost stays as told, and nothing is retried."""
    study = journal_study(tmp_path)
    ask = lambda: study.ask(SPACE)  # noqa: E731
    trial = take(study, 5, ask, "8_0", tmp_path)
    running = study.get_trials(states=(TrialState.RUNNING,))
    now = running[0].system_attrs[SEEN_ATTR]
    assert lost(running, {}, now + 10, stale_s=60) == []
    ((gone, why),) = lost(running, {}, now + 61, stale_s=60)
    assert why == "its worker job 8_0 was not seen for 61 s (node lost?)"
    study.ask(SPACE)  # a job-per-trial sweep's trial: no worker attribute, never judged here
    assert [t.number for t, _ in lost(study.get_trials(states=(TrialState.RUNNING,)), {"8_0": "CANCELLED"}, now)] == [0]

    assert lose(study, gone, why, tmp_path, max_retries=1).endswith("retried as trial 2")
    retry = take(study, 5, ask, "8_1", tmp_path)
    assert retry.number == 2 and retries_before(study.trials, study.trials[2]) == 1
    line = lose(study, study.trials[2], "again", tmp_path, max_retries=1)
    assert line == "trial 2 failed: again; its values ran 2 times, not retried" and len(study.trials) == 3

    told = take(study, 5, ask, "8_1", tmp_path)
    frozen = study.trials[told.number]
    study.tell(told, 0.5)
    assert lose(study, frozen, "late", tmp_path) == f"trial {told.number}: told by its worker after all"
    assert study.trials[told.number].state == TrialState.COMPLETE and len(study.trials) == told.number + 1
    del trial


def test_a_requeued_worker_takes_back_its_own_running_trial_and_no_other(tmp_path):
    """A worker job that Slurm requeued starts again with its job id: the trial it ran (still RUNNING under that id) is
    handed back to it, marked seen at once, so that it resumes in its run dir; another worker's running trial, or
    one the sweep failed meanwhile, is not."""
    study = journal_study(tmp_path)
    ask = lambda: study.ask(SPACE)  # noqa: E731
    mine, other, failed = (take(study, 5, ask, worker, tmp_path) for worker in ("9_0", "9_1", "9_0"))
    lose(study, study.trials[failed.number], "gone", tmp_path)
    before = study.trials[mine.number].system_attrs[SEEN_ATTR]
    (back,) = resumed(study, "9_0")
    assert back.number == mine.number and back.params == mine.params
    assert study.trials[mine.number].system_attrs[SEEN_ATTR] >= before and resumed(study, "9_2") == []
    assert [t.number for t in resumed(study, "9_1")] == [other.number]


def test_a_continued_study_keeps_a_waiting_retry_for_its_workers_and_fails_it_for_a_job_per_trial_sweep(tmp_path):
    """The sweep stopped (Ctrl-C, every worker gone) after a lost trial's retry was enqueued: the same command on
    workers leaves the retry for them to run first; on a job per trial (which asks only new trials) it is failed, with
    why, so that no trial is left WAITING."""
    study = journal_study(tmp_path)
    take(study, 5, lambda: study.ask(SPACE), "9_0", tmp_path)
    lose(study, study.trials[0], "gone", tmp_path)
    assert recover(study, keep_waiting=True) == ["trial 1: waiting (a retry); the study's workers run it first"]
    assert study.trials[1].state == TrialState.WAITING
    assert recover(study) == ["trial 1: a retry not run when the study stopped: failed"]
    assert study.trials[1].state == TrialState.FAIL and study.trials[1].user_attrs["error"] == "a retry not run when the study stopped"


def test_a_study_on_workers_stopped_continues_its_cut_off_trials_first_each_as_its_job_and_counts_them_once(tmp_path):
    """Ctrl-C on a study's sweep while two workers run trials 0 and 1 (n_trials=3): before it cancels them, the sweep
    fails both without an error (cut off) and marks the study stopped, so that a worker still alive until Slurm kills
    it asks no new trial. The same command continues: each is enqueued again (trials 2 and 3) and the new workers
    take them before any new trial, each at its cut-off trial's point and as its job (run dir 0, 1: it resumes
    there); n_trials counts the continuations, not the cut-off trials: one new trial follows, then none."""
    from hydra_plugins.tinker_exp_plugins.optuna_sweeper import StudyWorker
    from tinker_exp.sweep.workers import STOPPED_ATTR, stop_workers

    study = journal_study(tmp_path)
    cut = [take(study, 3, lambda: study.ask(SPACE), worker, tmp_path) for worker in ("9_0", "9_1")]
    for trial in cut:
        trial.set_user_attr("overrides", ["lora=r8", f"x={trial.params['x']}"])
        trial.set_user_attr("run_dir", str(tmp_path / str(trial.number)))
    stop_workers(study, tmp_path)  # the sweep's Ctrl-C
    assert [t.state for t in study.trials] == [TrialState.FAIL] * 2 and settled(study) == []  # cut off: not done
    assert take(study, 3, lambda: study.ask(SPACE), "9_0", tmp_path) is None and len(study.trials) == 2  # no new trial

    study._storage.set_study_system_attr(study._study_id, STOPPED_ATTR, False)  # the continued sweep's workers
    assert [line.split(" at ")[0] for line in recover(study, keep_waiting=True)] == [
        "trial 0 (cut off): continued as trial 2", "trial 1 (cut off): continued as trial 3"]  # fmt: skip
    worker = StudyWorker.__new__(StudyWorker)  # its point only: the overrides and the job number a trial runs with
    worker.fixed = ["lora=r8"]
    for cut_off in cut:
        again = take(study, 3, lambda: study.ask(SPACE), "10_0", tmp_path)
        assert again.params == cut_off.params
        assert worker.point(study, again) == (cut_off.user_attrs["overrides"], cut_off.number, f"trial {again.number}")
        study.tell(again, 1.0)
    new = take(study, 3, lambda: study.ask(SPACE), "10_0", tmp_path)
    assert new.number == 4 and worker.point(study, new)[1:] == (4, "trial 4")  # a new point: its own job
    study.tell(new, 2.0)
    assert take(study, 3, lambda: study.ask(SPACE), "10_0", tmp_path) is None and len(study.trials) == 5
    assert [t.number for t in settled(study)] == [2, 3, 4]


def test_a_worker_stopping_leaves_its_trial_running_for_its_requeued_start_and_takes_no_new_one(tmp_path):
    """A worker's job requeued (its time limit's signal) or cancelled while a trial trains on one of its slots: the
    slot's job ends without a result as the worker closes its slots; that is the worker's stop, not the trial's
    failure: the trial is not told (it stays RUNNING, the worker's), the worker asks no further trial, and its
    requeued start takes the trial back to resume it in its run dir. A slot's job that ends without a result while
    the worker goes on fails its trial, with why."""
    import threading
    from types import SimpleNamespace

    from hydra.core.utils import JobStatus

    from hydra_plugins.tinker_exp_plugins.launchers import job_error
    from hydra_plugins.tinker_exp_plugins.optuna_sweeper import slot_return
    from tinker_exp.sweep.workers import work

    study = journal_study(tmp_path)
    stopping, returned = threading.Event(), []

    def run(trial) -> None:  # as StudyWorker's: the worker's SystemExit closes its slots under the running trial
        stopping.set()
        returned.append(slot_return(SimpleNamespace(ret=None, state="CANCELLED"), ["x=1"], stopping.is_set()))

    assert work(study, 3, lambda: study.ask(SPACE), run, "9_0", tmp_path, stopping=stopping.is_set) == 1
    assert returned == [None] and [t.state for t in study.trials] == [TrialState.RUNNING]  # not told; no second trial
    (back,) = resumed(study, "9_0")
    assert back.number == 0
    failed = slot_return(SimpleNamespace(ret=None, state="FAILED"), ["x=1"], False)
    assert failed.status == JobStatus.FAILED and job_error(failed) == "RuntimeError: stopped on its slot (FAILED)"


def test_a_retry_starts_from_the_lost_trials_newest_checkpoint_before_its_end_else_from_step_0(tmp_path):
    """retry_start: a branch of the lost trial's run dir when it saved a usable checkpoint before its last step
    (the newest: 4); none for a trial that is no retry, a lost trial without checkpoints, with only a broken one, or
    whose newest is at its last step (a branch would train nothing)."""
    from tinker_exp.sweep.workers import retry_start
    from tinker_exp.train.checkpoints import begin_save, commit_save

    study = journal_study(tmp_path)
    ask = lambda: study.ask(SPACE)  # noqa: E731

    def lost_run(name: str, steps: int, saved: tuple[int, ...], broken: bool = False) -> Path:
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "config.yaml").write_text(f"trainer:\n  steps: {steps}\ncheckpoint:\n  dir: checkpoints\n")
        for step in saved:
            partial = begin_save(run_dir / "checkpoints", step)
            (partial / "workers" / "model.pt").write_bytes(b"weights")
            folder = commit_save(partial, step, {})
            if broken:
                (folder / "workers" / "model.pt").write_bytes(b"")  # shorter than its manifest says
        return run_dir

    runs = {"saved": lost_run("saved", 6, (2, 4)), "none": lost_run("none", 6, ()), "broken": lost_run("broken", 6, (2,), broken=True),
            "at_end": lost_run("at_end", 6, (6,))}  # fmt: skip
    starts = {}
    for name, run_dir in runs.items():
        lost = take(study, 10, ask, "7_0", tmp_path)
        lost.set_user_attr("run_dir", str(run_dir))
        study.enqueue_trial(dict(lost.params), user_attrs={RETRY_OF: lost.number})
        study.tell(lost, state=TrialState.FAIL)
        retry = take(study, 10, ask, "7_1", tmp_path)
        starts[name] = retry_start(study, retry)
        study.tell(retry, 1.0)
    assert starts == {"saved": [f"branch.from={runs['saved']}"], "none": [], "broken": [], "at_end": []}
    assert retry_start(study, take(study, 10, ask, "7_1", tmp_path)) == []  # no retry


def test_in_a_slurm_job_auto_trains_cold_unless_the_job_holds_a_pool_of_its_own(monkeypatch, tmp_path):
    """backend.pool=auto in a Slurm job: cold at once (its own allocation), without looking for the user's pool; with a
    study worker's pool in its environment (SWEEP_POOLS_ENV), that pool is asked (none answering here: cold, said)."""
    from helpers import compose
    from tinker_exp.config import load
    from tinker_exp.place import ColdGroup, lease, wire

    cfg = load(compose("backend.pool=auto"))
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.delenv(wire.SWEEP_POOLS_ENV, raising=False)
    assert lease.lease_a_pool(cfg) == ColdGroup()
    monkeypatch.setenv(wire.SWEEP_POOLS_ENV, str(tmp_path / "sweep-1-0.sock"))
    assert lease.lease_a_pool(cfg).why.startswith("pool: none is up, starting cold")


@pytest.mark.parametrize(
    "launcher, error",
    [
        (["hydra.launcher.workers=-1"], "hydra.launcher.workers=-1: must be an int >= 0 (0: a job per trial)"),
        (["hydra.launcher.workers=2", "hydra.launcher.nodes=2"], "hydra.launcher.workers=2 with hydra.launcher.nodes=2: study workers span one node"),
        (["hydra.launcher.slots=2"], "hydra.launcher.slots=2: on Slurm, slots hold a study worker's trials; set hydra.launcher.workers"),
    ],
)
def test_bad_workers_settings_are_one_line_before_anything_is_written(tmp_path, launcher, error):
    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m", "hydra/sweeper=optuna", "hydra/launcher=slurm_local", f"hydra.sweep.dir={sweep}", "override.lr=interval(1e-4,1e-3)",
        "+override=constant", *launcher,
    )  # fmt: skip
    assert result.returncode == 2 and error in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not sweep.exists()


# --- real: the suite's Slurm cluster ---------------------------------------------------------------------------------

TRIAL = ["trainer.steps=6", "logger=none", "backend.num_workers=1", "backend.pool=auto", "trainer.batch_size=4", "+override=constant"]
"""Tiny trials on a warm pool (backend.pool=auto: the suite's default is none)."""


def worker_python(job_id: str) -> int:
    """The pid of a worker job's own Python (submitit's `_submit`, not its pool's or Ray's processes)."""
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            command = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ and b"submitit.core._submit" in command:
            return int(proc.name)
    raise AssertionError(f"no worker process of job {job_id}")


def kill_a_worker_midway(command: list[str], env: dict, log: Path, ready, run_dir: Path, what: str) -> tuple[str, str]:
    """Run a sweep on workers; once `ready()` holds, kill -9 the Python of the worker whose job runs `run_dir`; wait
    for the sweep to exit 0. (What it printed, the killed worker's name: `<array job>_<task>`, as submitit and squeue
    name an array task.)"""
    with open(log, "w") as out:
        driver = subprocess.Popen(command, cwd=REPO, env=environment(env), stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_until(ready, 600, what, driver)
            killed = job_json(run_dir)["slurm"]
            os.kill(worker_python(killed["job_id"]), signal.SIGKILL)
            driver.wait(timeout=600)
        finally:
            driver.kill()
    output = log.read_text()
    assert driver.returncode == 0, output[-3000:]
    return output, f"{killed['array_job_id']}_{killed['array_task_id']}"


def test_a_study_on_two_worker_jobs_completes_when_one_is_killed_mid_trial(slurm_env, tmp_path):
    """A 3-point grid on 2 worker jobs (journal file in the sweep dir), checkpoints every 2 steps. The worker running
    trial 0 is killed with kill -9 once the trial has saved its step-2 checkpoint: the sweep sees its job end, fails
    trial 0 (why, in the log and the summary) and enqueues its values as trial 3, which the other worker takes after
    its own trials and runs on from trial 0's newest checkpoint (a branch of its run dir: its rows from that step on,
    each once). The study has its 3 trials (1, 2, 3 completed), the same values as the grid's points, every trial in
    the storage; each worker started its workers once (a pool in its allocation: one group built a job, later trials
    warm); both jobs left the queue."""
    command = [
        sys.executable, "-m", "tinker_exp", "-m", "hydra/sweeper=optuna", "hydra/launcher=slurm_local", f"hydra.sweep.dir={tmp_path}",
        "hydra.launcher.workers=2", "hydra.sweeper.sampler=grid", "override.lr=choice(1e-4,1e-3,1e-2)", *TRIAL,
        "checkpoint.every_steps=2",
    ]  # fmt: skip
    run_0 = tmp_path / "0"
    ready = lambda: (run_0 / "checkpoints" / "step_00000002").is_dir()  # noqa: E731
    output, worker = kill_a_worker_midway(command, slurm_env, tmp_path / "study.log", ready, run_0, "trial 0 saved no checkpoint")
    study = optuna.load_study(study_name="tinker_exp", storage=open_storage(f"journal://{tmp_path / 'optuna.journal'}"))
    trials = study.trials
    (retry,) = [t for t in trials if RETRY_OF in t.user_attrs]  # trial 2 or 3: when the loss was seen
    assert trials[0].state == TrialState.FAIL and all(t.state == TrialState.COMPLETE for t in trials[1:]), output[-3000:]
    assert len(trials) == 4 and retry.params == trials[0].params and retry.user_attrs[RETRY_OF] == 0
    assert sorted(t.params["override.lr"] for t in trials[1:]) == [1e-4, 1e-3, 1e-2]  # every grid point once
    why = f"its worker job {worker} ended (FAILED) while it ran"
    assert f"trial 0 failed: {why}; retried as trial {retry.number}" in output and trials[0].user_attrs["error"] == f"lost: {why}"
    summary = {row["num"]: row["status"] for row in read_jsonl(tmp_path / "summary.jsonl")}
    assert summary == {0: "FAILED", 1: "COMPLETED", 2: "COMPLETED", 3: "COMPLETED"}
    saved = OmegaConf.load(tmp_path / "optimization_results.yaml")
    assert [f.trial for f in saved.failed] == [0] and saved.n_complete == 3
    # the retry went on from trial 0's newest checkpoint (2 or 4: how far trial 0 got before the kill)
    start = read_jsonl(tmp_path / str(retry.number) / "metrics.jsonl")[0]["train/step"]
    assert start in (2, 4) and (run_0 / "checkpoints" / f"step_{start:08d}").is_dir(), start
    assert f"branch of {run_0} at step {start}" in (tmp_path / str(retry.number) / "tinker_exp.log").read_text()
    for trial in trials[1:]:
        run_dir = tmp_path / str(trial.number)
        first = start if trial.number == retry.number else 0
        assert [row["train/step"] for row in read_jsonl(run_dir / "metrics.jsonl")] == list(range(first, 6))  # each row once
        assert trial.value == read_json(run_dir / "objective.json")["value"] and trial.user_attrs["job_id"] != worker
        assert job_json(run_dir)["overrides"] == trial.user_attrs["overrides"]  # a job's own: no pool address added
    # One cold start a worker: the surviving job built one group; its later trials trained warm on it.
    survivor = sorted(t.number for t in trials[1:])
    logs = {n: (tmp_path / str(n) / "tinker_exp.log").read_text() for n in survivor}
    assert "group built" in logs[survivor[0]]
    assert all("group built" not in logs[n] and "pool: training on the warm workers of" in logs[n] and "a kept group" in logs[n] for n in survivor[1:])
    assert not squeue(slurm_env).strip()  # both workers gone: the killed one, and the other at the study's end


def test_a_requeued_study_worker_takes_back_its_trial_and_resumes_it_at_its_checkpoint(slurm_env, tmp_path):
    """One worker job, one trial of 30 steps with a checkpoint every 2. The worker gets the time-limit signal (USR2,
    what Slurm sends `signal_delay_s` before the limit) once the trial has saved its step-2 checkpoint: submitit
    requeues the job, and its second start takes back the trial (still its own in the storage, under the same job
    id) and runs it on in the same run dir from its newest checkpoint. The trial is told once and not taken for lost;
    each of its rows is logged once; its job.json says restart 1."""
    command = [
        sys.executable, "-m", "tinker_exp", "-m", "hydra/sweeper=optuna", "hydra/launcher=slurm_local", f"hydra.sweep.dir={tmp_path}",
        "hydra.launcher.workers=1", "hydra.sweeper.sampler=grid", "override.lr=choice(1e-3)", *TRIAL, "trainer.steps=30",
        "checkpoint.every_steps=2",
    ]  # fmt: skip
    slurm, log, run_0 = environment(slurm_env), tmp_path / "study.log", tmp_path / "0"
    with open(log, "w") as out:
        driver = subprocess.Popen(command, cwd=REPO, env=slurm, stdout=out, stderr=subprocess.STDOUT)
        try:
            # any step's: a trial this fast can save step 6 (and drop step 2, keep_last=2) between two looks
            saved = lambda: any((run_0 / "checkpoints").glob("step_*/MANIFEST.json"))  # noqa: E731
            wait_until(saved, 600, "the trial saved no checkpoint", driver)
            job = job_json(run_0)["slurm"]
            task = f"{job['array_job_id']}_{job['array_task_id']}" if "array_job_id" in job else job["job_id"]  # one worker: no array
            requeued_at = requeue_at_time_limit(slurm_env, job["job_id"], task, driver)
            driver.wait(timeout=900)
        finally:
            driver.kill()
    output = log.read_text()
    assert driver.returncode == 0, output[-3000:]
    (trial,) = optuna.load_study(study_name="tinker_exp", storage=open_storage(f"journal://{tmp_path / 'optuna.journal'}")).trials
    assert trial.state == TrialState.COMPLETE and RETRY_OF not in trial.user_attrs and "lost" not in output, output[-3000:]
    assert output.count("] trial 0: ") == 1, output[-3000:]  # told once
    rows = read_jsonl(run_0 / "metrics.jsonl")
    assert [row["train/step"] for row in rows] == list(range(30))  # each row once
    resumed_at = next(row["train/step"] for row in rows if row["time"] > requeued_at)
    assert resumed_at >= 2 and resumed_at % 2 == 0  # at a checkpoint's step (every 2), not step 0
    assert job_json(run_0)["slurm"]["restart_count"] == "1" and trial.value == read_json(run_0 / "objective.json")["value"]
    worker_log = "".join(p.read_text() for p in (tmp_path / ".submitit").rglob("*_log.*"))
    assert f"study worker {task}: requeued; trial 0 resumes in its run dir" in worker_log, worker_log[-3000:]


def test_ctrl_c_cancels_every_worker_at_once_on_a_study_kept_in_postgresql(slurm_env, postgres_url, tmp_path):
    """A study of LoRA trials on 2 workers of 2 slots each (hydra.launcher.slots=2) with its storage on the suite's
    PostgreSQL server: its 4 trials train at once, two in each worker job, each on a slot of its worker's one group.
    Interrupted once every trial has logged a step and trial 0 a few: Ctrl-C cancels both worker jobs with one scancel (one line naming both), leaves none in the queue,
    records the running trials failed (none left RUNNING or WAITING in the storage, none taken for lost), exits 130 with
    the command that continues it; the server's password is in nothing printed or written."""
    name = f"workers-{tmp_path.name}-{os.getpid()}"  # one server, many studies
    command = [
        sys.executable, "-m", "tinker_exp", "-m", "hydra/sweeper=optuna", "hydra/launcher=slurm_local", f"hydra.sweep.dir={tmp_path}",
        "hydra.launcher.workers=2", f"hydra.sweeper.storage={postgres_url}", f"hydra.sweeper.study_name={name}",
        "hydra.sweeper.n_trials=4", "override.lr=tag(log,interval(1e-5,1e-2))", *TRIAL[1:], "trainer.steps=400", "checkpoint.every_steps=4",
        "lora=r8", "hydra.launcher.slots=2",
    ]  # fmt: skip
    slurm, run_0 = environment(slurm_env), tmp_path / "0"
    # Ctrl-C as a terminal delivers it: SIGINT at its default in the driver (a suite run under `&` inherits it ignored).
    driver = subprocess.Popen(command, cwd=REPO, env=slurm, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        rows = lambda n: read_jsonl(tmp_path / str(n) / "metrics.jsonl") if (tmp_path / str(n) / "metrics.jsonl").exists() else []  # noqa: E731
        trained = lambda: len(rows(0)) > 2 and all(rows(n) for n in range(4))  # noqa: E731
        wait_until(trained, 600, "the 4 trials did not all train at once", driver)
        job = job_json(run_0)["slurm"]
        driver.send_signal(signal.SIGINT)
        output, _ = driver.communicate(timeout=300)
    finally:
        driver.kill()
    assert driver.returncode == 130, output[-3000:]
    (cancelled,) = [line for line in output.splitlines() if "interrupted: cancelled" in line]
    assert cancelled.endswith(f"interrupted: cancelled {job['array_job_id']}_0, {job['array_job_id']}_1"), cancelled
    assert "continue it with: python -m tinker_exp" in output and "Traceback" not in output and "lost" not in output
    wait_until(lambda: not squeue(slurm_env).strip(), 120, "worker jobs left in the queue", poll=1)
    trials = optuna.load_study(study_name=name, storage=postgres_url).trials
    assert trials and all(t.state in (TrialState.FAIL, TrialState.COMPLETE) for t in trials), [t.state for t in trials]
    assert not [t for t in trials if RETRY_OF in t.user_attrs] and "error" not in trials[0].user_attrs  # cut off, not lost
    steps = [row["train/step"] for row in read_jsonl(run_0 / "metrics.jsonl")]
    assert steps == list(range(len(steps)))  # each row once
    # two trials a worker job, each on a slot of the one group its worker built (for the first of them)
    jobs = [job_json(tmp_path / str(n))["slurm"]["array_task_id"] for n in range(4)]
    assert sorted(jobs) == ["0", "0", "1", "1"], jobs
    slot_lines = [re.search(r"slot (\d) of 2 on this process's group, built for (this|an earlier) trial",
                            (tmp_path / str(n) / "tinker_exp.log").read_text()) for n in range(4)]
    assert all(slot_lines) and sorted(line.group(2) for line in slot_lines) == ["an earlier", "an earlier", "this", "this"]
    password = postgres_url.split(":")[2].split("@")[0]
    written = [p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".yaml", ".json", ".jsonl", ".md", ".log")]
    assert password not in output and not any(password in text for text in written)
