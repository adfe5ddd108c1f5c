"""Hydra multirun sweeps: launcher presets, summaries and failure reports, and real sweeps on a local Slurm cluster."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import (
    COSINE_TRUNK,
    REPO,
    compose,
    environment,
    job_json,
    job_processes,
    planned,
    metrics_rows,
    read_job_log,
    read_jsonl,
    run_cli,
    run_main,
    squeue,
    start_cli,
    wait_until,
    wandb_train_rows,
    wandb_finished_records,
    wandb_run_record,
    without_timings,
)
from tinker_exp.sweep.slurm import ACTIVE_STATES, Verdicts
from tinker_exp.sweep.jobs import (
    JobOutcome,
    failure_report,
    points_at_once,
    read_outcome,
    run_name,
    slurm_job,
    summary_table,
    sweep_group,
    write_summary,
)

# --- pure: names, groups, summaries ------------------------------------------------------------------


def test_a_jobs_error_is_one_line_with_any_password_in_it_masked():
    """What a failed job raised is printed and saved (summary.md, optimization_results.yaml): a study's storage URL
    in it (a job that could not reach its study) keeps its password out."""
    from hydra.core.utils import JobReturn, JobStatus

    from hydra_plugins.tinker_exp_plugins.launchers import job_error

    ret = JobReturn(overrides=[], status=JobStatus.FAILED, _return_value=RuntimeError("no study at postgresql://bob:s3cr3t@db/s"))
    assert job_error(ret) == "RuntimeError: no study at postgresql://bob:***@db/s"


def test_sweep_group_is_the_sweep_dir_below_outputs_sweeps(tmp_path):
    assert sweep_group(str(tmp_path / "outputs/sweeps/2026-11-29/10-00-00"), cwd=tmp_path) == "2026-11-29/10-00-00"
    assert sweep_group("/elsewhere/lr_sweep", cwd=tmp_path) == "lr_sweep"


def test_run_name_comes_from_the_overrides():
    assert run_name(["+override=lr_cosine", "optimizer.lr=0.001"], "0") == "override=lr_cosine,optimizer.lr=0.001"
    assert run_name([], "3") == "3"


def test_slurm_job_reads_the_job_environment():
    assert slurm_job({"PATH": "/bin"}) is None
    job = slurm_job({"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "11", "SLURM_ARRAY_TASK_ID": "1"})
    assert job == {"job_id": "12", "array_job_id": "11", "array_task_id": "1"}


def test_summary_reads_each_run_dir_and_names_failures(tmp_path):
    done, failed = tmp_path / "0", tmp_path / "1"
    done.mkdir()
    failed.mkdir()
    (done / "metrics.jsonl").write_text("".join(json.dumps({"train/loss": x}) + "\n" for x in (3.0, 2.5, 2.25)))
    outcomes = [
        read_outcome(0, ["optimizer.lr=0.001"], "COMPLETED", done, None, "7_0"),
        read_outcome(1, ["optimizer.lr=-1"], "FAILED", failed, "config error: optimizer.lr=-1.0 ...", "7_1"),
    ]
    assert (outcomes[0].steps, outcomes[0].final_loss) == (3, 2.25)
    assert (outcomes[1].steps, outcomes[1].final_loss) == (0, None)
    summary = write_summary(tmp_path, outcomes)
    table = summary_table(outcomes)
    assert table in summary.read_text() and "config error: optimizer.lr=-1.0" in summary.read_text()
    assert [line.split()[:3] for line in table.splitlines()[2:]] == [
        ["0", "optimizer.lr=0.001", "COMPLETED"],
        ["1", "optimizer.lr=-1", "FAILED"],
    ]
    assert [JobOutcome(**row) for row in read_jsonl(tmp_path / "summary.jsonl")] == outcomes
    report = failure_report(outcomes, summary)
    assert report.startswith("1 of 2 sweep jobs did not complete") and f"run dir {failed}" in report
    assert "job 0" not in report


# --- presets -----------------------------------------------------------------------------------------


def fake_slurm(states: dict[str, list[str]], result_after: dict[str, int | None]):
    """Each job's Slurm states, one per poll; its result file appears at poll `result_after[job]` (None: never)."""
    polls = {"n": 0, "t": 0.0}

    def state(ids: list[str]) -> dict[str, str]:
        polls["n"] += 1
        return {job: states[job][min(polls["n"], len(states[job])) - 1] for job in ids}

    def sleep(seconds: float) -> None:
        polls["t"] += seconds

    written = {job: (lambda after=after: after is not None and polls["n"] >= after) for job, after in result_after.items()}
    return written, state, (lambda: polls["t"]), sleep


def test_a_requeued_job_is_waited_for_through_the_states_it_passes():
    # What a requeue can look like in sacct: a failed-looking moment, then back in the queue, then done.
    written, state, clock, sleep = fake_slurm({"1": ["RUNNING", "FAILED", "REQUEUED", "PENDING", "RUNNING", "RUNNING"]}, {"1": 6})
    assert Verdicts(written, state, poll_s=5, settle_s=20, clock=clock, sleep=sleep).of("1") is None


def test_a_job_slurm_ended_is_reported_once_its_state_holds():
    written, state, clock, sleep = fake_slurm({"1": ["RUNNING", "RUNNING", "CANCELLED"]}, {"1": None})
    assert Verdicts(written, state, poll_s=5, settle_s=20, clock=clock, sleep=sleep).of("1") == "CANCELLED"
    assert clock() == 10 + 20  # two polls running, then the settling time: never waited on forever


def test_jobs_that_ended_without_a_result_settle_side_by_side_not_one_after_another():
    """Three jobs cancelled at the same poll, asked for in order: the three verdicts take one settling time, not
    three (a grid on Slurm waited 20 s per such job, each after the one before); a job that wrote its result is None."""
    states = {"1": ["RUNNING", "CANCELLED"], "2": ["RUNNING", "CANCELLED"], "3": ["RUNNING", "CANCELLED"], "4": ["RUNNING"]}
    written, state, clock, sleep = fake_slurm(states, {"1": None, "2": None, "3": None, "4": 3})
    verdicts = Verdicts(written, state, poll_s=5, settle_s=20, clock=clock, sleep=sleep)
    assert [verdicts.of(job) for job in ("1", "2", "3", "4")] == ["CANCELLED", "CANCELLED", "CANCELLED", None]
    assert clock() == 5 + 20  # one poll running, then one settling time for all three


def test_a_continued_study_waits_for_the_jobs_of_its_cut_off_trials_to_leave_the_queue_bounded():
    """The Slurm jobs of trials cut off, cancelled as a study is continued, are waited for until they have left the
    queue (their continuations then take their run dirs); one still active after the wait is named."""
    from tinker_exp.sweep.slurm import left_queue

    seen = {"1": ["RUNNING", "COMPLETING", "CANCELLED"], "2": ["PENDING", "CANCELLED"]}
    polls = {"t": 0.0}

    def states_of(ids: list[str]) -> dict[str, str]:
        return {i: seen[i].pop(0) if len(seen[i]) > 1 else seen[i][0] for i in ids}

    def sleep(s: float) -> None:
        polls["t"] += s

    assert left_queue(["1", "2"], wait_s=60, poll_s=1, states_of=states_of, clock=lambda: polls["t"], sleep=sleep) == []
    assert polls["t"] == 2  # left at the third look
    stuck = {"3": ["RUNNING"]}
    assert left_queue(["3"], wait_s=5, poll_s=1, states_of=lambda ids: {"3": stuck["3"][0]}, clock=lambda: polls["t"], sleep=sleep) == ["3"]


def test_slurm_preset_has_the_keys_a_gpu_cluster_needs():
    launcher = compose("hydra/launcher=slurm", "backend.num_workers=8", with_hydra=True).hydra.launcher
    assert launcher._target_.endswith("SlurmSweepLauncher")
    for key in ("partition", "account", "qos", "timeout_min", "cpus_per_task", "mem_gb", "setup", "additional_parameters"):
        assert key in launcher, key
    assert launcher.gpus_per_node == 8  # one GPU per worker
    assert launcher.signal_delay_s < launcher.timeout_min * 60


def test_signal_delay_past_the_time_limit_fails_before_submitting(tmp_path):
    result = run_cli(
        "-m", "hydra/launcher=slurm_local", "dry_run=true", f"hydra.sweep.dir={tmp_path}",
        "hydra.launcher.timeout_min=1", "hydra.launcher.signal_delay_s=60",
    )  # fmt: skip
    assert result.returncode == 2
    assert "tinker_exp: config error: hydra.launcher.signal_delay_s=60 must be below hydra.launcher.timeout_min*60=60" in result.stderr
    assert not (tmp_path / ".submitit").exists()


def test_minus_m_sweeps_with_the_grid_sweeper_and_a_preset_still_picks_optuna():
    """Our GridSweeper is stored as hydra/sweeper=basic (Hydra's default); an hparams_search preset overrides it."""
    assert compose(with_hydra=True).hydra.sweeper._target_ == "hydra_plugins.tinker_exp_plugins.launchers.GridSweeper"
    assert compose("hparams_search=lr_cosine", with_hydra=True).hydra.sweeper._target_.endswith("OptunaSweeper")
    launcher = compose("hydra/launcher=local", "hydra.launcher.max_parallel=3", with_hydra=True).hydra.launcher
    assert launcher.max_parallel == 3 and launcher._target_.endswith("LocalSweepLauncher")


def test_local_points_at_once_are_as_many_as_the_cpus_hold_unless_set():
    assert points_at_once(cpus=16, workers_per_point=2, max_parallel=None) == 8  # a CPU a worker
    assert points_at_once(cpus=2, workers_per_point=2, max_parallel=None) == 1  # this machine: one point at a time
    assert points_at_once(cpus=3, workers_per_point=4, max_parallel=None) == 1  # never none
    assert points_at_once(cpus=None, workers_per_point=2, max_parallel=None) == 1  # os.cpu_count() unknown
    assert points_at_once(cpus=16, workers_per_point=2, max_parallel=3) == 3  # hydra.launcher.max_parallel wins


BAD_POINTS = ["+override.lr=1e-3,-1", "data.val_fraction=0.5,0.0001"]  # 4 points: only the first is good
BAD_POINTS_REPORT = [
    "tinker_exp: config error: 3 of 4 sweep points are wrong; no job was started:",
    "  job 1 [+override.lr=0.001 data.val_fraction=0.0001]: config error: data.val_fraction: 0.0001 of 256 rows "
    "leaves 256 for training and 0 for validation (both need rows; null: no validation)",  # the data rows, read
    "  job 2 [+override.lr=-1 data.val_fraction=0.5]: config error: override.lr: must be >= 0, got -1",
    "  job 3 [+override.lr=-1 data.val_fraction=0.0001]: config error: override.lr: must be >= 0, got -1",
]


def assert_refused_before_any_job(result: subprocess.CompletedProcess, sweep_dir: Path) -> None:
    """Exit 2, every bad point named with its overrides and its one-line error, and nothing else; nothing written."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == BAD_POINTS_REPORT, result.stderr
    assert not sweep_dir.exists()  # no multirun.yaml, no job dir, no .submitit (so no job was submitted)


def test_local_sweep_with_bad_points_is_refused_before_any_job(tmp_path):
    """Batches of one: the bad points of later batches are found before the first batch runs."""
    sweep = tmp_path / "sweep"
    result = run_cli("-m", "hydra/launcher=local", "hydra.sweeper.max_batch_size=1", f"hydra.sweep.dir={sweep}", *BAD_POINTS)
    assert_refused_before_any_job(result, sweep)


def test_max_parallel_is_checked_before_anything_runs(tmp_path):
    result = run_cli("-m", "hydra/launcher=local", "hydra.launcher.max_parallel=0", "dry_run=true", f"hydra.sweep.dir={tmp_path / 's'}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("tinker_exp: config error: hydra.launcher.max_parallel=0: must be an int >= 1")
    assert not (tmp_path / "s" / ".submitit").exists()


FULL_FINE_TUNING = "hydra.launcher.slots={}: lora.rank=0: full fine-tuning keeps one trial per group; slots hold LoRA trials (1: one trial a group)"


@pytest.mark.parametrize(
    "args, message",
    [
        (["hydra.launcher.slots=0"], "hydra.launcher.slots=0: must be an int >= 1 (1: one trial a group) or auto"),
        (["hydra.launcher.slots=many"], "hydra.launcher.slots=many: must be an int >= 1 (1: one trial a group) or auto"),
        (["hydra.launcher.slots=2", "trainer.seed=0,1"], FULL_FINE_TUNING.format(2)),
        # a population's members: checked against the slots before multirun.yaml is written, as a grid's points
        (["hparams_search=pbt_lr_cosine", "hydra.launcher.slots=2"], FULL_FINE_TUNING.format(2)),
    ],
    ids=["zero", "not-a-number", "full-fine-tuning", "a-population-of-full-fine-tuning"],
)  # fmt: skip
def test_slots_are_refused_for_points_that_cannot_share_a_group_before_anything_runs(monkeypatch, capsys, tmp_path, args, message):
    """hydra.launcher.slots > 1 holds LoRA trials only: a grid or a population of other points is refused (every
    bad point named), exit 2, nothing written."""
    code, out, err = run_main(monkeypatch, capsys, "-m", "hydra/launcher=local", *args, f"hydra.sweep.dir={tmp_path / 's'}")
    assert code == 2, err
    assert message in err, err
    assert "Traceback" not in out + err and not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    "args, slots",
    [
        ([], 3),  # trials on the local launcher's slots
        (["hydra/launcher=slurm_local", "hydra.launcher.workers=2"], 2),  # on each study worker's: refused before sbatch
    ],
    ids=["local", "study-workers"],
)
def test_a_study_none_of_whose_points_can_take_the_slots_is_refused_as_a_grid_is(monkeypatch, capsys, tmp_path, args, slots):
    """hparams_search=lr_cosine without LoRA on slots: every trial would be refused (it searches no key that makes a
    point LoRA), so the study is, in one line, before anything is written (no multirun.yaml, journal or summary)."""
    code, out, err = run_main(monkeypatch, capsys, "-m", "hparams_search=lr_cosine", *args, f"hydra.launcher.slots={slots}",
                              f"hydra.sweep.dir={tmp_path / 's'}")  # fmt: skip
    assert code == 2 and err.strip().splitlines() == [f"tinker_exp: config error: {FULL_FINE_TUNING.format(slots)}"], err
    assert not (tmp_path / "s").exists()


def test_a_job_python_that_is_no_command_is_refused_before_anything_runs(tmp_path):
    result = run_cli("-m", "hydra/launcher=local", "hydra.launcher.python=no-such-python", "dry_run=true", f"hydra.sweep.dir={tmp_path / 's'}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "tinker_exp: config error: hydra.launcher.python=no-such-python: not a command found on PATH (null: this interpreter)"
    )
    assert not (tmp_path / "s").exists()


def test_local_sweep_in_batches_runs_max_parallel_points_at_a_time_and_counts_once(tmp_path):
    """4 points in batches of 3 (hydra.sweeper.max_batch_size), one at a time (hydra.launcher.max_parallel=1);
    resume=must fails in its job (its run dir holds no checkpoint: found only there), in the first batch.
    Every batch runs anyway; one table and one failure count over the whole sweep, and no Hydra hint after it."""
    result = run_cli(
        "-m", "hydra/launcher=local", "hydra.launcher.max_parallel=1", "hydra.sweeper.max_batch_size=3", "dry_run=true",
        f"hydra.sweep.dir={tmp_path}", "resume=must,auto", "trainer.steps=2,3",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    rows = sorted(read_jsonl(tmp_path / "summary.jsonl"), key=lambda row: row["num"])
    assert [(row["num"], row["status"]) for row in rows] == [(0, "FAILED"), (1, "FAILED"), (2, "COMPLETED"), (3, "COMPLETED")]
    assert result.stderr.count("did not complete") == 1 and "tinker_exp: error: 2 of 4 sweep jobs did not complete" in result.stderr
    for num, steps in ((0, 2), (1, 3)):
        message = f"job {num} [dry_run=True resume=must trainer.steps={steps}] FAILED: config error: resume=must, but there is no checkpoint"
        assert message in result.stderr and f"run dir {tmp_path}/{num}" in result.stderr
    assert "HYDRA_FULL_ERROR" not in result.stderr and "Traceback" not in result.stderr
    assert result.stdout.count("sweep summary") == 1 and result.stdout.count("final loss") == 1  # one table, at the end
    assert "3 local jobs, at most 1 at a time" in result.stdout
    # Each job's start and end said as they happen (a grid is never silent until its last job starts): one at a time.
    said = [line.split("[HYDRA] ")[1] for line in result.stdout.splitlines() if line.partition("[HYDRA] ")[2].startswith("job ")]
    ends = [f"job {n} FAILED: config error: resume=must" for n in (0, 1)] + [f"job {n}: completed, 0 steps logged; run dir {tmp_path}/{n}" for n in (2, 3)]
    assert len(said) == 8 and [s.split(" (process")[0] for s in said[::2]] == [f"job {n} started" for n in range(4)], said
    assert all(line.startswith(end) for line, end in zip(said[1::2], ends)), said
    # One at a time: each job started (its job.json, written first) after the one before had written its result.
    spans = []
    for row in rows:
        job_id = row["job_id"]
        started = (Path(row["run_dir"]) / "job.json").stat().st_mtime_ns
        ended = (tmp_path / ".submitit" / job_id / f"{job_id}_0_result.pkl").stat().st_mtime_ns
        spans.append((started, ended))
    assert all(ended_before <= started_after for (_, ended_before), (started_after, _) in zip(spans, spans[1:])), spans


def test_a_study_trial_whose_point_is_bad_fails_without_a_job_and_the_study_goes_on(tmp_path):
    """An odd batch does not split over 2 workers: each sampled point is refused by the checks, so its trial
    fails at once (no job, no run dir), the study asks every trial and exits 1 with one line."""
    result = run_cli(
        "-m", "hydra/sweeper=optuna", "hydra/launcher=local", f"hydra.sweep.dir={tmp_path}",
        "trainer.batch_size=choice(3,5)", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=2",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("tinker_exp: error: none of the 3 trials completed")
    assert "HYDRA_FULL_ERROR" not in result.stderr
    assert result.stdout.count("trial 0 failed: config error: trainer.batch_size") == 1
    assert result.stdout.count("study summary") == 1
    assert not [p for p in tmp_path.iterdir() if p.name.isdigit()] and not list(tmp_path.glob(".submitit/*/*_result.pkl"))
    assert [row["status"] for row in read_jsonl(tmp_path / "summary.jsonl")] == ["FAILED"] * 3


# --- real sweeps on the local Slurm cluster ----------------------------------------------------------


def test_a_sweep_of_two_node_points_runs_each_as_a_slurm_job_resumes_a_preempted_one_and_reports_a_cancelled_one(slurm_env, tmp_path):
    """hydra.launcher.nodes=2: each point one run over both nodes of its job (one after the other on this cluster),
    one Slurm array, one W&B group. Point 0 (1000 steps), which gets the nodes first, is cancelled while it trains on
    both nodes: reported, never waited on, stopped on SIGTERM by itself on both nodes. Point 1 (24 steps, a cosine
    lr, a checkpoint every 4), which gets the nodes then, is preempted after its step-8 checkpoint (scontrol requeue:
    Slurm signals the job and puts it back in the queue; its first start stops by itself), resumes from its
    checkpoint with its Ray cluster formed again over both nodes, logs each step once with the lr as planned, and
    completes: one run dir and one W&B run, nothing left of its job on either node. The sweep's summary, table and
    report.png hold both points. (The cancelled point first: the launcher takes a job's end from Slurm once its state
    has held for a while, and waits for its jobs in order, so point 0's is taken while point 1 trains.) The other
    kind of requeue, submitit's own at the time-limit signal (USR2), is test_study's Slurm study: its trial 0 gets
    the signal and reports on."""
    sweep, slurm = tmp_path / "lr_sweep", environment(slurm_env)
    command = [
        sys.executable, "-m", "tinker_exp", "-m", "hydra/launcher=slurm_local", "hydra.launcher.nodes=2", "backend.num_workers=1",
        f"hydra.sweep.dir={sweep}", "trainer.steps=1000,24", "checkpoint.every_steps=4", "+override=lr_cosine",
    ]  # fmt: skip
    out, err = tmp_path / "driver.out", tmp_path / "driver.err"  # files, not pipes: nobody reads them until the end
    with open(out, "w") as stdout, open(err, "w") as stderr:
        driver = subprocess.Popen(command, cwd=REPO, env=slurm, stdout=stdout, stderr=stderr)
    tasks = lambda n: "{array_job_id}_{array_task_id}".format(**job_json(sweep / str(n))["slurm"])  # noqa: E731  submitit's and squeue's name
    try:
        wait_until(lambda: len(metrics_rows(sweep / "0")) >= 2, 300, "point 0 never started training", driver)
        wait_until(lambda: wandb_train_rows(sweep / "0"), 120, "W&B never wrote a step of point 0", driver)
        job_id = job_json(sweep / "0")["slurm"]["job_id"]
        running = job_processes([job_id])
        assert {"n1", "n2"} <= {process.split()[1] for process in running}, running  # the run spans both nodes
        # the array task, not its job id: `scancel <array id>` would cancel point 1, waiting in the queue, too
        subprocess.run(["scancel", tasks(0)], env=slurm, check=True)
        checkpoint = sweep / "1" / "checkpoints" / "step_00000008" / "MANIFEST.json"  # point 1 got the nodes
        wait_until(checkpoint.exists, 300, "point 1 saved no checkpoint at step 8", driver)
        preempted = job_json(sweep / "1")["slurm"]["job_id"]
        subprocess.run(["scontrol", "requeue", tasks(1)], env=slurm, check=True)
        wait_until(lambda: f"{tasks(1)} PENDING" in squeue(slurm_env).splitlines(), 240, "point 1 was not requeued", driver)
        # Slurm holds a requeued batch job for a while (so that its new credential postdates the old one's
        # revocation). Released sooner, as test_study's requeued trial: a few seconds after its first start has left
        # the nodes (a start in the same second as the revocation is killed by slurmd: "Job credential revoked").
        wait_until(lambda: not job_processes([preempted]), 240, "point 1's first start did not end", driver)
        released = subprocess.run(["scontrol", "update", f"JobId={tasks(1)}", "StartTime=now+5"], env=slurm, capture_output=True, text=True)
        assert released.returncode == 0 or f"{tasks(1)} PENDING" not in squeue(slurm_env).splitlines(), released.stderr
        driver.wait(timeout=300)  # point 0 reported, never waited on forever
    finally:
        driver.kill()
    stdout, stderr = out.read_text(), err.read_text()
    assert driver.returncode == 1, stderr[-3000:]
    report = stderr.split("1 of 2 sweep jobs did not complete")[1]  # point 1, requeued, completed
    assert "job 0 [backend.num_workers=1 trainer.steps=1000 checkpoint.every_steps=4 +override=lr_cosine backend.nodes=2] CANCELLED" in report, stderr
    assert f"run dir {sweep}/0" in report and "job 1" not in report
    summary = sorted(read_jsonl(sweep / "summary.jsonl"), key=lambda row: row["num"])
    assert [(row["num"], row["status"]) for row in summary] == [(0, "CANCELLED"), (1, "COMPLETED")]
    assert "final loss" in (sweep / "summary.md").read_text() and "final loss" in stdout  # the table printed too
    assert (sweep / "report.png").read_bytes()[:4] == b"\x89PNG" and f"{sweep / 'report.png'}" in stderr + stdout
    jobs = [job_json(sweep / str(n))["slurm"] for n in (0, 1)]
    assert len({job["array_job_id"] for job in jobs}) == 1  # one Slurm array
    # point 1: preempted, resumed and completed over both nodes
    row, run_dir, job = summary[1], sweep / "1", jobs[1]
    assert row["steps"] == 24 and job["job_id"].isdigit() and job["partition"] == "debug" and job["num_nodes"] == "2"
    assert job["restart_count"] == "1"  # the second start
    starts = [line for line in (run_dir / "tinker_exp.log").read_text().splitlines() if "workers: " in line]
    assert len(starts) == 2 and all("Ray nodes: " in line for line in starts)  # both starts span the nodes
    assert_one_rank_per_node(run_dir)
    assert_nothing_left(slurm_env, job["job_id"])
    assert row["job_id"] == f"{job['array_job_id']}_{job['array_task_id']}"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["train/step"] for m in metrics] == list(range(24))  # each step once across both starts
    assert [m["applied/lr"] for m in metrics] == planned(run_dir, "lr")  # the plan continued
    assert row["final_loss"] == metrics[-1]["train/loss"] and row["objective"] == metrics[-1]["val/loss"]  # what the job returned
    # One W&B run a point (task 0's), resumed: offline, a part per start, each of the run's id.
    parts = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(parts) == 2 and all(part.name == f"run-{(run_dir / 'wandb_run_id').read_text()}.wandb" for part in parts), parts
    records = wandb_finished_records(parts[1])  # W&B's service may write the exit record a moment later
    run = wandb_run_record(records)
    assert run.run_group == "lr_sweep" and run.display_name == "backend.num_workers=1,trainer.steps=24,checkpoint.every_steps=4,override=lr_cosine,backend.nodes=2"
    assert [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"] == [0]
    # Its first start stopped by itself (not killed at KillWait), leaving no result behind for the launcher. Slurm
    # signals every process of the job at once. 143: our SIGTERM handler stopped the run; 1: Ray's raylet died first
    # and Ray's core worker ended the driver (it does that on losing its raylet; a race we cannot win under load).
    job_log = read_job_log(sweep, tasks(1))
    assert re.search(r"task 0: Exited with exit code (143|1)$", job_log, re.M) and "Killed" not in job_log, job_log[-3000:]
    # point 0: stopped on SIGTERM by itself, well before Slurm's SIGKILL, and wrote no result of its own.
    task = tasks(0)
    job_log = read_job_log(sweep, task)
    # It ended by itself, before Slurm's SIGKILL: through our SIGTERM handler (exit 143, its one line), through the
    # launcher when the other node's workers died first (exit 143, no result: docs/multi-node.md), or through Ray's
    # core worker when the raylet died first (exit 1; Slurm signals every process of the job at once).
    assert re.search(r"task 0: Exited with exit code (143|1)$", job_log, re.M) and "Killed" not in job_log, job_log[-3000:]
    assert not list((sweep / ".submitit" / task).glob("*_0_result.pkl"))  # task 0's: the run's
    steps = [m["train/step"] for m in metrics_rows(sweep / "0")]
    assert steps == list(range(len(steps))) and len(steps) >= 2
    # scancel signals every process of the job, W&B's service too (wandb/wandb#9963): the run cannot be
    # finished, and steps it had not yet written are lost. What it wrote agrees with metrics.jsonl.
    logged = wandb_train_rows(sweep / "0")
    assert logged and [row["train/step"] for row in logged] == steps[: len(logged)]
    # then Slurm reaps every process of the job (COMPLETING until then), on both nodes: Ray's too
    assert_nothing_left(slurm_env, job_id, files=False)


def test_slurm_sweep_with_bad_points_is_refused_before_any_job(slurm_env, tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli("-m", "hydra/launcher=slurm_local", f"hydra.sweep.dir={sweep}", *BAD_POINTS, env=slurm_env)
    assert_refused_before_any_job(result, sweep)


SBATCH_REFUSES = [
    ["optimizer.lr=1e-3,1e-4", "dry_run=true"],  # a grid: one job array
    ["hparams_search=lr_cosine", "hydra.sweeper.n_trials=2"],  # a study's first trial: one sbatch
    ["hparams_search=lr_cosine", "hydra.launcher.workers=2"],  # its workers: one job array
    ["hparams_search=pbt_lr_cosine"],  # a population: one job array, a job a member
]


@pytest.mark.parametrize("args", SBATCH_REFUSES, ids=["grid", "study", "study-workers", "population"])
def test_a_partition_sbatch_refuses_is_sbatchs_one_line_and_the_sweep_leaves_nothing(slurm_env, monkeypatch, capsys, tmp_path, args):
    """sbatch's own message (was submitit's FailedJobError traceback), naming the key it is about, exit 2; the sweep dir
    this command made (multirun.yaml, .submitit/, a study's journal, a population's ledger) is removed: no job was
    submitted. The local cluster answers at once: nothing waits."""
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
    code, out, err = run_main(monkeypatch, capsys, "-m", "hydra/launcher=slurm_local", "hydra.launcher.partition=nope", *args,
                              f"hydra.sweep.dir={tmp_path / 'sweep'}")  # fmt: skip
    assert code == 2 and err.strip().splitlines() == [
        "tinker_exp: config error: hydra.launcher.partition=nope: sbatch refused the sweep's jobs: sbatch: error: invalid "
        "partition specified: nope; sbatch: error: Batch job submission failed: Invalid partition name specified"
    ], err
    assert "Traceback" not in out and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("args", SBATCH_REFUSES[:3], ids=["grid", "study", "study-workers"])
def test_a_slurm_sweep_where_slurm_has_no_commands_is_one_line_and_leaves_nothing(monkeypatch, capsys, tmp_path, args):
    """No srun or sbatch on PATH (submitit's RuntimeError traceback before): one line, exit 2, the sweep dir removed."""
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    code, out, err = run_main(monkeypatch, capsys, "-m", "hydra/launcher=slurm_local", *args, f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert code == 2 and err.strip().splitlines() == [
        "tinker_exp: config error: hydra/launcher=slurm_local: Slurm's commands (srun, sbatch) are not on PATH here; submit "
        "from a machine of the cluster, or use hydra/launcher=local"
    ], err
    assert "Traceback" not in out and not (tmp_path / "sweep").exists()


def test_sweep_with_a_point_failing_in_its_job_fails_that_job_and_completes_the_others(slurm_env, tmp_path):
    """resume=must passes the checks before the sweep (it depends on the run dir) and fails in its job."""
    result = run_cli(
        "-m", "hydra/launcher=slurm_local", f"hydra.sweep.dir={tmp_path}", "trainer.steps=2", "logger=none",
        "backend.num_workers=1", "resume=auto,must",
        env=slurm_env, timeout=600,
    )  # fmt: skip
    assert result.returncode == 1
    assert "HYDRA_FULL_ERROR" not in result.stderr
    report = result.stderr.split("1 of 2 sweep jobs did not complete")[1]
    assert "job 1 [trainer.steps=2 logger=none backend.num_workers=1 resume=must] FAILED: config error: resume=must" in report
    assert f"run dir {tmp_path}/1" in report and "job 0" not in report
    summary = read_jsonl(tmp_path / "summary.jsonl")
    assert [(row["status"], row["steps"]) for row in summary] == [("COMPLETED", 2), ("FAILED", 0)]
    assert "tinker_exp: config error: resume=must" in read_job_log(tmp_path, summary[1]["job_id"])
    assert job_json(tmp_path / "1")["slurm"]["job_id"]  # it did run under Slurm


def assert_nothing_left(slurm_env: dict, job_id: str, files: bool = True) -> None:
    """Once Slurm is done with the job, no process of it runs on any node (Ray's processes included: one that
    escaped Slurm's process tracking would still be there); `files`: and its Ray files are gone (a job that ended
    by itself; a cancelled one can leave its head's, see the README)."""
    queued = lambda: subprocess.run(["squeue", "-h", "-o", "%A"], env=environment(slurm_env), capture_output=True, text=True).stdout  # noqa: E731
    wait_until(lambda: job_id not in queued().split(), 90, f"job {job_id} still in squeue", poll=1)  # %A: an array task's own id
    # Slurm's SIGTERM reached every process (a Ray node stops at once: ray_cluster.NO_DRAIN); one whose task died
    # first is no longer tracked by Slurm (proctrack/linuxproc), so it may end after the job has left the queue.
    wait_until(lambda: job_processes([job_id]) == [], 90, f"processes of job {job_id} still running: {job_processes([job_id])}", poll=1)
    assert not files or not list(Path("/tmp").glob(f"ray_job_{job_id}_*"))


def sacct_state(slurm_env: dict, job_id: str) -> str:
    from tinker_exp.sweep.slurm import slurm_state

    return slurm_state(job_id, env=environment(slurm_env))


RAY_TOKEN = "tinker-exp-test-ray-token-0123456789abcdef"


def ray_nodes_of_ranks(run_dir: Path) -> list[tuple[str, str]]:
    """(Slurm node, Ray node id) of each rank, as the run logged where its workers landed."""
    line = next(line for line in (run_dir / "tinker_exp.log").read_text().splitlines() if "Ray nodes: " in line)
    return re.findall(r"rank \d+ (\S+) \(([0-9a-f]{8})\)", line.split("Ray nodes: ")[1])


def assert_one_rank_per_node(run_dir: Path) -> None:
    """Each rank on a Ray node of its own, each Ray node on a Slurm node of its own: n1 and n2."""
    nodes = ray_nodes_of_ranks(run_dir)
    assert sorted(slurm for slurm, _ in nodes) == ["n1", "n2"] and len({ray for _, ray in nodes}) == 2, nodes


def test_multinode_recipe_on_two_nodes(slurm_env, cosine_trunk, tmp_path):
    """launchers/slurm_multinode.sbatch on 2 Slurm nodes, one worker each (world size 2): a Ray node per Slurm node,
    one rank on each, applied == requested every step, the losses of the same run on one node with 2 workers bitwise
    (the suite's shared CLI run, conftest.py cosine_trunk: same world size, sharding, data order and gloo reductions
    over 2 ranks), and nothing left of the job after it."""
    run_dir, rendezvous = tmp_path / "run", tmp_path / "rendezvous"
    run = [*COSINE_TRUNK, "logger=none"]  # the trunk's command (W&B aside: it changes no step)
    submitted = subprocess.run(
        [
            "sbatch", "--parsable", "--nodes=2", "--cpus-per-task=1", f"--output={tmp_path}/slurm-%j.out",
            "launchers/slurm_multinode.sbatch", *run, "backend.num_workers=1", f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env=environment({**slurm_env, "TINKER_EXP_PYTHON": sys.executable, "RAY_AUTH_TOKEN": RAY_TOKEN,
                         "TINKER_EXP_RAY_RENDEZVOUS": str(rendezvous)}),
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    # The job's end as it happens: `sbatch --wait` looks 2, 10, 42, 74, 106 ... s after the submission (its poll
    # backs off to 32 s), up to half a minute after the job ended.
    wait_until(lambda: sacct_state(slurm_env, job_id) not in ACTIVE_STATES, 600, f"job {job_id} did not end", poll=0.5)
    (log,) = tmp_path.glob("slurm-*.out")
    text = log.read_text()
    assert sacct_state(slurm_env, job_id) == "COMPLETED", text[-3000:]  # its batch script exited 0
    job = job_json(run_dir)
    assert job["slurm"]["num_nodes"] == "2" and job["slurm"]["job_id"] == job_id and log.name == f"slurm-{job_id}.out"
    assert "2 node(s)" in text and "the Ray head is gone; this node stopped" in text  # the other task ended with it
    assert_one_rank_per_node(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["train/step"] for m in rows] == list(range(12))
    assert [m["applied/lr"] for m in rows] == [m["requested/lr"] for m in rows] == planned(run_dir, "lr")
    config = (run_dir / "config.yaml").read_text()
    address = text.split("Ray head ")[1].split()[0]
    assert f"ray_address: {address}" in config and "nodes: 2" in config  # joined the allocation's Ray, 2 nodes
    assert [m["train/loss"] for m in rows] == [m["train/loss"] for m in read_jsonl(cosine_trunk[0] / "metrics.jsonl")]
    # nothing of the job left: no process on either node, no Ray files, no head address; the token never written
    assert_nothing_left(slurm_env, job["slurm"]["job_id"])
    assert not list(rendezvous.iterdir())
    written = [p.read_text(errors="replace") for p in [log, *run_dir.rglob("*")] if p.is_file()]
    assert not any(RAY_TOKEN in text for text in written)


def test_ctrl_c_in_the_submitting_process_cancels_the_jobs(slurm_env, tmp_path):
    import signal

    command = [
        sys.executable, "-m", "tinker_exp", "-m", "hydra/launcher=slurm_local", f"hydra.sweep.dir={tmp_path}",
        "trainer.steps=1000", "logger=none", "backend.num_workers=1", "optimizer.lr=1e-3,3e-4",
    ]  # fmt: skip
    # Ctrl-C as a terminal delivers it: SIGINT at its default in the driver. A suite started in the background by a
    # non-interactive shell (CI behind `&`) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
    driver = subprocess.Popen(
        command, cwd=REPO, env=environment(slurm_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        both_run = lambda: all((tmp_path / str(n) / "job.json").exists() for n in (0, 1))  # noqa: E731
        wait_until(both_run, 120, "the jobs never started", driver)
        slurm = [job_json(tmp_path / str(n))["slurm"] for n in (0, 1)]
        job_ids = [f"{job['array_job_id']}_{job['array_task_id']}" for job in slurm]  # as submitit names them
        driver.send_signal(signal.SIGINT)
        output, _ = driver.communicate(timeout=120)
    finally:
        driver.kill()
    assert driver.returncode != 0 and f"interrupted: cancelled {', '.join(job_ids)}" in output, output[-3000:]
    continued = "tinker_exp: interrupted (Ctrl-C); continue it with: python -m tinker_exp " + shlex.join(
        [*(a for a in command[3:] if not a.startswith("hydra.sweep.dir=")), f"hydra.sweep.dir={tmp_path}"]
    )
    assert "Traceback" not in output and output.strip().splitlines()[-1] == continued, output[-3000:]
    # Slurm's accounting records both as cancelled (not merely gone from the queue)
    states = lambda: [sacct_state(slurm_env, job_id) for job_id in job_ids]  # noqa: E731
    wait_until(lambda: states() == ["CANCELLED", "CANCELLED"], 120, f"not cancelled in sacct: {states()}", poll=1)


def test_sigterm_on_a_sweep_of_trials_on_slots_stops_them_as_ctrl_c_does_and_exits_143(ray_address, tmp_path):
    """SIGTERM (`timeout`, a batch system) to a sweep's process whose trials are threads on slots of its own LoRA
    group (Ray's driver started in a thread of that process): every trial stops at its next step as a run stops on
    SIGTERM (its run dir's lock removed), and the process exits 143 with the line that continues the sweep, no stack
    dump. Before, the process ended at once (Ray's failure handler, then the default action), trials and all."""
    import signal

    command = [
        sys.executable, "-m", "tinker_exp", "-m", "hydra/launcher=local", f"hydra.sweep.dir={tmp_path}", "lora=r8",
        "trainer.seed=0,7", "trainer.steps=1000", "logger=none", "checkpoint.every_steps=0",
    ]  # fmt: skip
    log = tmp_path / "driver.log"  # its stdout and stderr, as written
    driver = start_cli(*command[3:], env={"RAY_ADDRESS": ray_address}, output=log)
    try:
        wait_until(lambda: all(len(metrics_rows(tmp_path / n)) >= 1 for n in "01"), 300, "the trials never trained", driver)
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=120)
    finally:
        driver.kill()
    output = log.read_text()
    assert driver.returncode == 143 and "2 local jobs, 2 at a time on the slots of one group" in output, output[-3000:]
    assert "interrupted: cancelled slot-job-0, slot-job-1" in output, output[-3000:]
    continued = "tinker_exp: terminated (SIGTERM); continue it with: python -m tinker_exp " + shlex.join([*(a for a in command[3:] if not a.startswith("hydra.sweep.dir=")), f"hydra.sweep.dir={tmp_path}"])
    assert "Traceback" not in output and "SIGTERM received" not in output and output.strip().splitlines()[-1] == continued, output[-3000:]
    for n in "01":
        assert len(metrics_rows(tmp_path / n)) < 1000 and not (tmp_path / n / "tinker_exp.lock").exists()
        assert "tinker_exp: stopped: terminated by SIGTERM" in (tmp_path / ".slots" / f"{n}.log").read_text()


def test_ctrl_c_in_a_local_sweep_stops_the_running_point_and_starts_no_other(ray_address, tmp_path):
    """hydra.launcher.max_parallel=1, on the sweep's own warm pool: each job a thread of the sweep's process leasing
    the pool (no process a job). Point 1 waits for point 0; Ctrl-C while point 0 trains stops it on the pool, and
    point 1 is never started."""
    import signal

    command = [
        sys.executable, "-m", "tinker_exp", "-m", "hydra/launcher=local", "hydra.launcher.max_parallel=1",
        f"hydra.sweep.dir={tmp_path}", "trainer.steps=1000", "logger=none", "backend.num_workers=1", "optimizer.lr=1e-3,3e-4",
    ]  # fmt: skip
    log = tmp_path / "driver.log"  # its stdout and stderr, as written
    # its jobs on the sweep's own warm pool (the suite's default is a cold start); Ctrl-C as a terminal delivers it
    driver = start_cli(*command[3:], env={"TINKER_EXP_POOL": "auto"}, default_sigint=True, output=log)
    try:
        wait_until(lambda: len(metrics_rows(tmp_path / "0")) >= 1, 300, "point 0 never trained", driver)
        driver.send_signal(signal.SIGINT)
        driver.wait(timeout=120)
    finally:
        driver.kill()
    output = log.read_text()
    assert driver.returncode == 130 and "interrupted: cancelled slot-job-0" in output, output[-3000:]
    assert "job 0 started (a thread of this process, on a pool of the sweep)" in output and not (tmp_path / ".submitit").exists()
    assert "1 local jobs" not in output and "2 local jobs, at most 1 at a time" in output
    # No traceback, and one line that says how to continue: the same overrides in the same sweep dir.
    continued = "tinker_exp: interrupted (Ctrl-C); continue it with: python -m tinker_exp " + shlex.join([*(a for a in command[3:] if not a.startswith("hydra.sweep.dir=")), f"hydra.sweep.dir={tmp_path}"])
    assert "Traceback" not in output and output.strip().splitlines()[-1] == continued, output[-3000:]
    assert not (tmp_path / "1").exists()
    # The sweep's own warm pool (docs/pool.md): started before its first job, trained it, stopped it, ended after.
    assert "pool: 1 warm pool(s) for this sweep's jobs" in output and "pool: the sweep's 1 pool(s) ended" in output
    assert "pool: training on the workers just built on" in (tmp_path / "0" / "tinker_exp.log").read_text()  # its first job
    assert len(metrics_rows(tmp_path / "0")) < 1000 and "done:" not in (tmp_path / "0" / "tinker_exp.log").read_text()  # stopped on the pool
    assert not list(Path(os.environ["TINKER_EXP_POOL_DIR"]).glob(f"sweep-{driver.pid}-*.sock"))


def test_a_grid_trains_a_shared_plan_prefix_once_each_point_bitwise_its_run_alone(ray_address, tmp_path):
    """Two WSD points of 12 steps (decays of 2 and 6 steps) on the local launcher, 2 at a time on the session's Ray
    cluster: point 1's plan is point 0's before step 7, so it waits for point 0's step-7 checkpoint (saved and kept
    for it) and trains steps 7..11 only. Its metrics.jsonl and W&B run hold every step, bitwise its run alone (a cold
    run of its command beside the sweep) but for timings, steps 0..6 marked shared_from 0; the sweep's first lines say
    the steps trained. The same command again trains nothing (every run is complete)."""
    from tinker_exp.train.start import SHARED_FROM

    env = {"RAY_ADDRESS": ray_address}
    common = ["+override=lr_wsd", "trainer.steps=12", "override.lr.warmup_steps=2", "backend.num_workers=1", "checkpoint.every_steps=4"]
    alone = start_cli(*common, "override.lr.decay_steps=6", f"hydra.run.dir={tmp_path / 'alone'}", env=env)
    sweep = tmp_path / "grid"
    command = ["-m", "hydra/launcher=local", "hydra.launcher.max_parallel=2", f"hydra.sweep.dir={sweep}", *common, "override.lr.decay_steps=2,6"]
    result = run_cli(*command, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert alone.wait(timeout=600) == 0
    said = result.stdout.splitlines()
    line = "shared prefixes: 1 of 2 points branch from another's checkpoint; 17 steps trained of the grid's 24"
    assert line in said[0] and "2 local jobs, at most 2 at a time" in result.stdout, result.stdout[-3000:]
    assert [(row["num"], row["status"], row["steps"]) for row in sorted(read_jsonl(sweep / "summary.jsonl"), key=lambda r: r["num"])] == [
        (0, "COMPLETED", 12), (1, "COMPLETED", 12)]  # fmt: skip
    log = (sweep / "1" / "tinker_exp.log").read_text()
    checkpoint = sweep / "0" / "checkpoints" / "step_00000007"
    assert f"shared prefix: steps 0..6 as job 0 trained them (its checkpoint {checkpoint}); this run trains from step 7" in log
    assert checkpoint.is_dir() and (sweep / "0" / "checkpoints" / "step_00000012").is_dir()  # kept past keep_last=2 for point 1

    rows, alone_rows = metrics_rows(sweep / "1"), metrics_rows(tmp_path / "alone")
    assert [row.get(SHARED_FROM) for row in rows] == [0] * 7 + [None] * 5
    assert without_timings([{k: v for k, v in row.items() if k != SHARED_FROM} for row in rows]) == without_timings(alone_rows)
    assert without_timings(rows[:7]) == without_timings([{**row, SHARED_FROM: 0} for row in metrics_rows(sweep / "0")[:7]])
    source = metrics_rows(sweep / "0")  # at step 7 the very same state, then each point's own lr
    assert rows[7]["train/loss"] == source[7]["train/loss"] and rows[8]["train/loss"] != source[8]["train/loss"]
    assert [(row["train/step"], row["train/loss"], row.get(SHARED_FROM)) for row in wandb_train_rows(sweep / "1")] == [
        (row["train/step"], row["train/loss"], row.get(SHARED_FROM)) for row in rows]  # its W&B run has every step too

    again = run_cli(*command, env=env, timeout=600)  # a rerun: each point is complete, nothing trains twice
    assert again.returncode == 0, again.stderr[-3000:]
    assert line in again.stdout and metrics_rows(sweep / "1") == rows
    for num in (0, 1):
        assert f"run complete: {sweep / str(num)} is done at step 12" in (sweep / str(num) / "tinker_exp.log").read_text()


def test_a_trial_on_a_slot_starts_from_the_composition_its_check_made_as_from_its_own(tmp_path):
    """A study's trial on a slot is composed once (launchers.py `point_error` keeps it for slot_jobs.py `prepare`):
    its job's config, .hydra files, run dir, group choices and job record are those a composition of its own gives."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import JobRuntime
    from hydra import initialize_config_dir
    from hydra.types import HydraContext, RunMode
    from omegaconf import OmegaConf

    from hydra_plugins.tinker_exp_plugins.launchers import point_error
    from hydra_plugins.tinker_exp_plugins.slot_jobs import prepare
    from tinker_exp.config import CONF_DIR, register

    register()
    sweep = ["hparams_search=lr_cosine", "lora=r8", "trainer.steps=20", "hydra.launcher.slots=8"]
    trial = [*sweep, "override.lr.value=0.0006466422717414558", "override.lr.warmup_steps=0.1787", "override.lr.min_ratio=0.3"]
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        loader = GlobalHydra.instance().config_loader()
        config = loader.load_configuration("config", [*sweep, f"hydra.sweep.dir={tmp_path}"], RunMode.MULTIRUN)
        JobRuntime.instance().set("name", "tinker_exp")
        context = HydraContext(config_loader=loader, callbacks=None)
        composed: dict = {}
        assert point_error(context, config, trial, None, 8, composed)[1] is None and list(composed) == [tuple(trial)]
        once, own = prepare(context, config, trial, 3, composed.pop(tuple(trial))), prepare(context, config, trial, 3)
    assert OmegaConf.to_yaml(once.task) == OmegaConf.to_yaml(own.task) and once.hydra_files == own.hydra_files
    assert (once.run_dir, once.choices, once.job, once.log_file) == (own.run_dir, own.choices, own.job, own.log_file)
    assert once.run_dir == tmp_path / "3" and "override.lr.value=0.0006466422717414558" in once.hydra_files["overrides.yaml"]


def test_a_slot_trials_helper_threads_write_to_its_own_log_not_the_sweeps(tmp_path):
    """Trials as threads of one process (the one router, threads.py, as slot_jobs.py installs it): a thread a trial
    starts for its run (sinks.py's `Background`, which starts its W&B run; the RL sampler) logs and prints into that
    trial's files, as the trial's own thread does; a thread nobody's run started (a library's) still goes to the
    sweep's terminal."""
    import io
    import logging
    import threading

    from tinker_exp import threads
    from tinker_exp.train.sinks import Background

    router, terminal = threads.Router(), io.StringIO()
    sweeps = logging.StreamHandler(terminal)
    sweeps.addFilter(threads.NotRouted(router))
    logger = logging.getLogger("test_slot_helper_threads")
    logger.handlers, logger.propagate, logger.level = [threads.RoutedRecords(router), sweeps], False, logging.INFO
    stream = threads.RoutedStream(router, "stdout", terminal)
    both_routed = threading.Barrier(2)  # the two trials' helpers run while both trials are routed

    def trial(n: int) -> None:
        printed = open(tmp_path / f"{n}.out", "w")
        router.add(threads.Route(printed, printed, threads.run_log(tmp_path / f"{n}.log")))
        both_routed.wait(timeout=30)
        Background(lambda: (logger.info(f"W&B run of trial {n}"), stream.write(f"printed by trial {n}'s helper\n")))()
        library = threading.Thread(target=lambda: logger.info(f"a library's thread beside trial {n}"))
        library.start(), library.join()
        route = router.remove()
        route.records.close(), printed.close()

    trials = [threading.Thread(target=trial, args=(n,)) for n in (0, 1)]
    [t.start() for t in trials], [t.join(timeout=60) for t in trials]
    for n, other in ((0, 1), (1, 0)):
        said, printed = (tmp_path / f"{n}.log").read_text(), (tmp_path / f"{n}.out").read_text()
        assert f"W&B run of trial {n}" in said and f"trial {other}" not in said, said
        assert printed == f"printed by trial {n}'s helper\n", printed
    assert "W&B run" not in terminal.getvalue() and "printed by" not in terminal.getvalue(), terminal.getvalue()
    assert terminal.getvalue().count("a library's thread beside trial") == 2, terminal.getvalue()
